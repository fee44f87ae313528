"""The read counter against the views: blocks and bytes per step, row and layer."""

from __future__ import annotations

import random

from paged_world import TOL, fill_interleaved, make_world, random_view

from declattn.engine.reads import BlockRead, ReadCounter


def test_counter_equals_view_on_every_step_and_counts_bytes() -> None:
    world = make_world(4, 2, windows=(None, 8, None))
    fill_interleaved(world, {1: 60, 2: 45}, seed=4)
    counter = ReadCounter()
    rng = random.Random(9)
    views: dict[tuple[int, int], tuple[int, ...]] = {}
    for _ in range(20):
        rows = []
        for sid in (1, 2):
            view = random_view(rng, world.lengths[sid] + 1, 4)
            if rng.random() < 0.2:
                view = None
            rows.append((sid, 1, view))
        _, _, steps = world.step(rows, counter)
        for st in steps:
            n_blocks = -(-st.length // 4)
            views[(counter.n_steps - 1, st.seq_id)] = (
                tuple(range(n_blocks)) if st.view is None else tuple(st.view)
            )
    per_token = world.cache.config.bytes_per_token
    expected_bytes = 0
    for (step, sid), view in views.items():
        per_layer = counter.per_step(sid)[step]
        assert per_layer == {0: view, 2: view}
    for rec in counter.records:
        if rec.sliding:
            continue
        length = world.lengths[rec.seq_id] - (counter.n_steps - 1 - rec.step)
        rows = sum(min(4, length - b * 4) for b in rec.blocks)
        assert rec.n_bytes == rows * per_token
        expected_bytes += rec.n_bytes
    assert counter.total_bytes() == expected_bytes
    assert counter.total_blocks() == 2 * sum(len(v) for v in views.values())
    assert sum(counter.bytes_per_sequence().values()) == expected_bytes
    assert counter.total_bytes(sliding=True) == 20 * 2 * 8 * per_token
    for (step, sid) in views:  # one row's bytes, from the per-row index, against a scan
        for sliding in (False, True):
            scan = sum(r.n_bytes for r in counter.records
                       if (r.step, r.seq_id, r.sliding) == (step, sid, sliding))
            assert counter.total_bytes(sliding=sliding, seq_id=sid, step=step) == scan > 0
            assert counter.row_bytes(step, sid, sliding=sliding) == scan
    counter.reset()
    assert counter.records == [] and counter.n_steps == 0 and counter.total_bytes() == 0
    assert counter.row_bytes(0, 0) == 0


def test_prefill_rows_are_not_counted_and_ignore_views() -> None:
    world = make_world(4, 2)
    counter = ReadCounter()
    outs, refs, _ = world.step([(1, 20, [4])], counter)
    assert (outs[0].double() - refs[0]).abs().max() < TOL
    assert counter.records == []


def test_recording_a_row_on_many_layers_keeps_what_recording_each_layer_keeps() -> None:
    """``record_layers`` (what a batched step calls: one row, a plan its layers share)
    against ``record`` of each layer's ``BlockRead``, over random rows, steps and layers."""
    rng = random.Random(5)
    one, many = ReadCounter(), ReadCounter()
    for step in range(6):
        for seq_id in rng.sample(range(5), 3):
            for row in range(rng.randint(1, 3)):
                for sliding in (False, True):
                    layers = sorted(rng.sample(range(8), rng.randint(1, 8)))
                    blocks = tuple(sorted(rng.sample(range(20), rng.randint(0, 6))))
                    n_bytes = rng.randint(0, 999)
                    many.record_layers(layers, step, seq_id, row, blocks, n_bytes, sliding)
                    for layer in layers:
                        one.record(BlockRead(step, layer, seq_id, blocks, n_bytes, sliding, row))
    assert one.records == many.records
    for rec in one.records:
        for sliding in (False, True):
            key = (rec.step, rec.seq_id, rec.layer)
            assert one.blocks_read(*key, sliding=sliding, row=rec.row) == many.blocks_read(
                *key, sliding=sliding, row=rec.row)
            assert one.row_bytes(rec.step, rec.seq_id, rec.row, sliding=sliding) == (
                many.row_bytes(rec.step, rec.seq_id, rec.row, sliding=sliding))
            assert one.total_bytes(sliding=sliding, seq_id=rec.seq_id, step=rec.step) == (
                many.total_bytes(sliding=sliding, seq_id=rec.seq_id, step=rec.step))
        assert one.per_step(rec.seq_id) == many.per_step(rec.seq_id)
    assert many.row_bytes(0, 99) == 0 and many.blocks_read(0, 99, 0) is None
