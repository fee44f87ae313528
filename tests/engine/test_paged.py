"""Paged attention against the dense fp64 reference: views over fragmented pools, batches
mixing prefill and decode rows, sliding windows, and the checks on bad views."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from paged_world import (
    GQA,
    HEAD_DIM,
    SCALE,
    TOL,
    World,
    dense_reference,
    fill_interleaved,
    make_world,
    n_runs,
    random_view,
)

from declattn.engine.paged import PagedAttention
from declattn.engine.reads import ReadCounter
from declattn.engine.seq_step import SeqStep


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
def test_decode_with_views_matches_dense_on_fragmented_pool(
    n_heads: int, n_kv: int, kernel: str
) -> None:
    world = make_world(n_heads, n_kv, windows=(None, None))
    fill_interleaved(world, {1: 37, 2: 50, 3: 23})
    assert all(n_runs(world.cache.block_table(s)) > 2 for s in (1, 2, 3))
    rng = random.Random(n_heads * 10 + n_kv)
    counter = ReadCounter()
    for _ in range(12):
        rows = []
        for sid in (1, 2, 3):
            rows.append((sid, 1, random_view(rng, world.lengths[sid] + 1, 4)))
        outs, refs, steps = world.step(rows, counter)
        for o, r in zip(outs, refs, strict=True):
            assert (o.double() - r).abs().max() < TOL
        for st in steps:
            for layer in (0, 1):
                assert counter.blocks_read(counter.n_steps - 1, st.seq_id, layer) == tuple(st.view)


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
def test_all_blocks_view_equals_full_causal(n_heads: int, n_kv: int) -> None:
    world = make_world(n_heads, n_kv)
    fill_interleaved(world, {1: 41, 2: 30}, seed=3)
    length = world.lengths[1] + 1
    all_blocks = list(range(-(-length // 4)))
    q = world.rand(1, n_heads, HEAD_DIM)
    k = world.rand(1, n_kv, HEAD_DIM)
    v = world.rand(1, n_kv, HEAD_DIM)
    world.cache.allocate(1, length)
    full = PagedAttention(world.cache, [SeqStep(1, length - 1, 1, all_blocks)])
    none = PagedAttention(world.cache, [SeqStep(1, length - 1, 1, None)])
    a = full(0, q, k, v, scale=SCALE, window=None)
    b = none(0, q, k, v, scale=SCALE, window=None)
    assert torch.equal(a, b)
    ks = torch.cat([world.truth_k[(0, 1)], k.double()])
    vs = torch.cat([world.truth_v[(0, 1)], v.double()])
    ref = dense_reference(q[0], ks, vs, torch.ones(length, dtype=torch.bool))
    assert (a[0].double() - ref).abs().max() < TOL


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_chunked_prefill_equals_one_shot(n_heads: int, n_kv: int, window: int | None) -> None:
    total = 45
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(total, n_heads, HEAD_DIM, generator=gen)
    k = torch.randn(total, n_kv, HEAD_DIM, generator=gen)
    v = torch.randn(total, n_kv, HEAD_DIM, generator=gen)

    one = make_world(n_heads, n_kv, windows=(window,))
    one.cache.allocate(9, 3)  # shift the physical layout so the two caches differ
    out_one, ref_one, _ = one.step([(1, total, None)], qkv={0: (q, k, v)})
    assert (out_one[0].double() - ref_one[0]).abs().max() < TOL

    chunked = make_world(n_heads, n_kv, windows=(window,))
    pieces = []
    for a, b in [(0, 10), (10, 11), (11, 29), (29, 45)]:
        chunked.cache.allocate(100 + a, 5)  # fragment the table between chunks
        chunked.cache.allocate(1, b)
        attn = PagedAttention(chunked.cache, [SeqStep(1, a, b - a)])
        pieces.append(attn(0, q[a:b], k[a:b], v[a:b], scale=SCALE, window=window))
    assert n_runs(chunked.cache.block_table(1)) > 1
    assert torch.allclose(torch.cat(pieces), out_one[0], atol=TOL, rtol=0)


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
def test_sliding_window_prefill_and_decode(n_heads: int, n_kv: int, kernel: str) -> None:
    windows = (None, 6, 9, 1, 1000)
    world = make_world(n_heads, n_kv, windows=windows)
    fill_interleaved(world, {1: 33, 2: 18}, seed=7)
    counter = ReadCounter()
    rng = random.Random(1)
    for _ in range(6):
        rows = [(s, 1, random_view(rng, world.lengths[s] + 1, 4)) for s in (1, 2)]
        outs, refs, steps = world.step(rows, counter)
        for o, r in zip(outs, refs, strict=True):
            assert (o.double() - r).abs().max() < TOL
        step = counter.n_steps - 1
        for st in steps:
            for layer, window in list(enumerate(windows))[1:]:
                lo = max(0, st.length - window)
                want = tuple(range(lo // 4, (st.length - 1) // 4 + 1))
                assert counter.blocks_read(step, st.seq_id, layer, sliding=True) == want
                assert counter.blocks_read(step, st.seq_id, layer) is None
                rec = [
                    r
                    for r in counter.records
                    if r.step == step and r.seq_id == st.seq_id and r.layer == layer
                ]
                n_read = min(window, st.length)
                assert rec[0].n_bytes == n_read * world.cache.config.bytes_per_token
            assert counter.blocks_read(step, st.seq_id, 0) == tuple(st.view)


def test_batch_of_three_views_with_a_prefill_equals_each_alone(kernel: str) -> None:
    world = make_world(8, 2, windows=(None, 5))
    fill_interleaved(world, {1: 29, 2: 40, 3: 17}, seed=11)
    world.cache.allocate(4, 3)
    world.lengths[4] = 0
    rows = [(1, 1, [0, 7]), (4, 3, None), (2, 1, [2, 3, 4, 10]), (3, 1, [4])]
    steps = []
    for sid, n_new, view in rows:
        start = world.lengths[sid]
        world.cache.allocate(sid, start + n_new)
        steps.append(SeqStep(sid, start, n_new, view))
    total = sum(s.n_new for s in steps)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(total, 8, HEAD_DIM, generator=gen)
    k = torch.randn(total, 2, HEAD_DIM, generator=gen)
    v = torch.randn(total, 2, HEAD_DIM, generator=gen)
    batch = PagedAttention(world.cache, steps)
    for layer, window in ((0, None), (1, 5)):
        together = batch(layer, q, k, v, scale=SCALE, window=window)
        row = 0
        for st in steps:
            sl = slice(row, row + st.n_new)
            alone = PagedAttention(world.cache, [st])(
                layer, q[sl], k[sl], v[sl], scale=SCALE, window=window
            )
            assert torch.allclose(together[sl], alone, atol=1e-6, rtol=0)
            row += st.n_new


def test_view_missing_newest_block_raises() -> None:
    world = make_world(4, 2)
    fill_interleaved(world, {1: 20})
    world.cache.allocate(1, 21)
    with pytest.raises(ValueError, match="newest"):
        PagedAttention(world.cache, [SeqStep(1, 20, 1, [0, 1, 2, 3, 4])])
    with pytest.raises(ValueError, match="newest"):
        PagedAttention(world.cache, [SeqStep(1, 20, 1, [])])
    with pytest.raises(ValueError, match="outside"):
        PagedAttention(world.cache, [SeqStep(1, 20, 1, [5, 6])])
    with pytest.raises(ValueError, match="allocate"):
        PagedAttention(world.cache, [SeqStep(1, 24, 1, [6])])
    with pytest.raises(ValueError, match="twice"):
        PagedAttention(world.cache, [SeqStep(1, 20, 1, [5]), SeqStep(1, 20, 1, [5])])


@pytest.fixture(scope="module", params=GQA, ids=lambda p: f"gqa{p[0] // p[1]}")
def filled(request: pytest.FixtureRequest) -> World:
    n_heads, n_kv = request.param
    world = make_world(n_heads, n_kv, windows=(None,), seed=n_heads + n_kv)
    fill_interleaved(world, {1: 53, 2: 31, 3: 46}, seed=n_kv)
    return world


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=hst.data())
def test_random_views_match_dense_property(
    filled: World, kernel: str, data: hst.DataObject
) -> None:
    sid = data.draw(hst.sampled_from([1, 2, 3]))
    length = filled.lengths[sid]
    n_blocks = -(-length // 4)
    others = data.draw(hst.sets(hst.integers(0, n_blocks - 2))) if n_blocks > 1 else set()
    view = sorted(others | {n_blocks - 1})
    counter = ReadCounter()
    outs, refs, _ = filled.step([(sid, 1, view)], counter, rewrite_last=True)
    assert (outs[0].double() - refs[0]).abs().max() < TOL
    assert counter.blocks_read(0, sid, 0) == tuple(view)


def test_decode_reads_are_what_the_layer_calls_read(kernel: str) -> None:
    """``decode_reads`` hands a native layer runner the pools, the new rows and the runs the
    per-layer calls use: the kernel over them gives those calls' output exactly, and its
    ``record`` counts what they count. Only a pure decode step on the native kernels gets
    one; a prefill step gets ``None``, a decode step it cannot plan the reason."""
    from declattn.engine.native import decode_op

    world = make_world(4, 2, windows=(None, 6))
    fill_interleaved(world, {1: 37, 2: 20})
    world.cache.allocate(1, 38)
    world.cache.allocate(2, 21)
    step = [SeqStep(1, 37, 1, [0, 3, 9])]
    if kernel == "torch":
        reason = PagedAttention(world.cache, step).decode_reads(world.windows)
        assert reason == "decode attention on the torch kernel"
        return
    counters = ReadCounter(), ReadCounter()
    by_layers = PagedAttention(world.cache, step, counters[0])
    planned = PagedAttention(world.cache, step, counters[1])
    reads = planned.decode_reads(world.windows)
    assert not isinstance(reads, str | None)
    assert torch.equal(reads.rows, world.cache.slots(1, 37, 38))
    for layer, window in enumerate(world.windows):
        q = world.rand(1, 4, HEAD_DIM)
        k, v = world.rand(1, 2, HEAD_DIM), world.rand(1, 2, HEAD_DIM)
        want = by_layers(layer, q, k, v, scale=SCALE, window=window)
        got = decode_op()(q, reads.k_pools[layer], reads.v_pools[layer], reads.runs[layer],
                          reads.offsets[layer], SCALE, reads.min_split_rows)
        assert torch.equal(got, want)
    reads.record()
    assert counters[1].records == counters[0].records
    assert counters[1].blocks_read(0, 1, 0) == (0, 3, 9)
    assert counters[1].total_bytes(sliding=True) > 0

    def reads_of(steps: list[SeqStep]):
        return PagedAttention(world.cache, steps).decode_reads(world.windows)

    assert reads_of([SeqStep(1, 30, 8, None)]) is None  # a prefill row
    selecting = reads_of([SeqStep(1, 37, 1, None, select=lambda layer, q: None)])
    assert selecting == "query-aware selection (a layer's blocks depend on its query)"
    apart = reads_of([SeqStep(1, 37, 1, None), SeqStep(2, 20, 1, None)])  # rows apart
    assert torch.equal(apart.rows, torch.cat([world.cache.slots(1, 37, 38),
                                              world.cache.slots(2, 20, 21)]))
    with pytest.raises(ValueError, match="1 windows for 2 layers"):
        PagedAttention(world.cache, step).decode_reads([None])
