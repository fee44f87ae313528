"""Paged attention against a dense masked reference, and the read counter against views.

The reference keeps every sequence's keys and values in plain fp64 tensors and applies
a mask that keeps exactly the positions a row may see; the paged path must agree while
reading only the kept blocks out of a fragmented pool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from declattn.engine.attention import (
    PREFILL_STRATEGIES,
    PagedAttention,
    ReadCounter,
    RunPlan,
    SeqStep,
    decode_runs,
    prefill_attention,
)
from declattn.engine.kv import KVCache, KVConfig

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
TOL = 1e-5


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
    """Query rows ``q [R, H, D]`` (or one row ``[H, D]``) over ``k, v [L, Hkv, D]``,
    row ``r`` seeing the positions where ``keep [R, L]`` (or ``[L]``) is True; fp64."""
    if q.dim() == 2:
        return dense_reference(q[None], k, v, keep[None])[0]
    n_heads, n_kv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(n_heads // n_kv, dim=1)
    vv = v.double().repeat_interleave(n_heads // n_kv, dim=1)
    s = torch.einsum("rhd,lhd->rhl", q.double(), kk) * SCALE
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", torch.softmax(s, dim=-1), vv)


@dataclass
class World:
    """A paged cache plus the fp64 truth of everything stored in it."""

    cache: KVCache
    n_heads: int
    windows: tuple[int | None, ...]
    gen: torch.Generator
    truth_k: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    truth_v: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    @property
    def n_kv(self) -> int:
        return self.cache.config.n_kv_heads

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=self.cache.config.dtype)

    def step(
        self,
        rows: Sequence[tuple[int, int, Sequence[int] | None]],
        counter: ReadCounter | None = None,
        qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        rewrite_last: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[SeqStep]]:
        """Run one batch step over every layer; returns (paged out, reference out) per
        layer. ``rows``: (seq_id, n_new, view). ``rewrite_last`` re-runs the newest
        position with its stored k/v (the cache is left unchanged)."""
        steps = []
        for sid, n_new, view in rows:
            start = self.lengths.get(sid, 0) - (1 if rewrite_last else 0)
            self.cache.allocate(sid, start + n_new)
            steps.append(SeqStep(sid, start, n_new, view))
        total = sum(st.n_new for st in steps)
        attn = PagedAttention(self.cache, steps, counter)
        outs, refs = [], []
        for layer, window in enumerate(self.windows):
            q = self.rand(total, self.n_heads, HEAD_DIM)
            if qkv is not None:
                q, k, v = qkv[layer]
            elif rewrite_last:
                k = torch.cat([self.truth_k[(layer, st.seq_id)][-1:] for st in steps])
                v = torch.cat([self.truth_v[(layer, st.seq_id)][-1:] for st in steps])
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                k = self.rand(total, self.n_kv, HEAD_DIM)
                v = self.rand(total, self.n_kv, HEAD_DIM)
            outs.append(attn(layer, q, k, v, scale=SCALE, window=window))
            refs.append(self._reference(layer, window, steps, q, k, v, rewrite_last))
        if not rewrite_last:
            for st in steps:
                self.lengths[st.seq_id] = st.length
        return outs, refs, steps

    def _reference(self, layer, window, steps, q, k, v, rewrite_last) -> torch.Tensor:
        bs = self.cache.block_size
        out = torch.empty(q.shape, dtype=torch.float64)
        row = 0
        for st in steps:
            key = (layer, st.seq_id)
            old_k = self.truth_k.get(key, torch.empty(0, self.n_kv, HEAD_DIM))
            old_v = self.truth_v.get(key, torch.empty(0, self.n_kv, HEAD_DIM))
            if not rewrite_last:
                new_k = k[row : row + st.n_new].double()
                new_v = v[row : row + st.n_new].double()
                old_k = torch.cat([old_k.double(), new_k])
                old_v = torch.cat([old_v.double(), new_v])
                self.truth_k[key], self.truth_v[key] = old_k, old_v
            pos = torch.arange(st.length)[None, :]
            qpos = torch.arange(st.start, st.length)[:, None]
            keep = pos <= qpos
            if window is not None:
                keep &= pos > qpos - window
            elif st.n_new == 1 and st.view is not None:
                keep &= torch.isin(pos // bs, torch.tensor(list(st.view)))
            sl = slice(row, row + st.n_new)
            out[sl] = dense_reference(q[sl], old_k, old_v, keep)
            row += st.n_new
        return out


def make_world(
    n_heads: int,
    n_kv: int,
    windows: tuple[int | None, ...] = (None,),
    num_blocks: int = 256,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> World:
    cfg = KVConfig(
        n_layers=len(windows),
        n_kv_heads=n_kv,
        head_dim=HEAD_DIM,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    return World(KVCache(cfg), n_heads, windows, gen)


def fill_interleaved(world: World, targets: dict[int, int], seed: int = 0) -> None:
    """Prefill several sequences in random interleaved chunks so that their block
    tables are fragmented (not physically consecutive)."""
    rng = random.Random(seed)
    while any(world.lengths.get(s, 0) < n for s, n in targets.items()):
        rows = []
        for sid, n in targets.items():
            have = world.lengths.get(sid, 0)
            if have < n:
                rows.append((sid, min(n - have, rng.randrange(2, 9)), None))
        rng.shuffle(rows)
        outs, refs, _ = world.step(rows)
        for o, r in zip(outs, refs, strict=True):
            assert torch.allclose(o.double(), r, atol=TOL, rtol=0)


def n_runs(table: Sequence[int]) -> int:
    return 1 + sum(1 for a, b in zip(table, table[1:], strict=False) if b != a + 1)


def random_view(rng: random.Random, length: int, bs: int) -> list[int]:
    n_blocks = -(-length // bs)
    kept = {b for b in range(n_blocks - 1) if rng.random() < 0.4}
    return sorted(kept | {n_blocks - 1})


GQA = [(4, 4), (4, 2), (8, 2)]


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
def test_decode_with_views_matches_dense_on_fragmented_pool(n_heads: int, n_kv: int) -> None:
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


@pytest.mark.parametrize("strategy", PREFILL_STRATEGIES)
@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_chunked_prefill_equals_one_shot(
    n_heads: int, n_kv: int, window: int | None, strategy: str
) -> None:
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
        attn = PagedAttention(chunked.cache, [SeqStep(1, a, b - a)], prefill_strategy=strategy)
        pieces.append(attn(0, q[a:b], k[a:b], v[a:b], scale=SCALE, window=window))
    assert n_runs(chunked.cache.block_table(1)) > 1
    assert torch.allclose(torch.cat(pieces), out_one[0], atol=TOL, rtol=0)


@pytest.mark.parametrize(("n_heads", "n_kv"), GQA)
def test_sliding_window_prefill_and_decode(n_heads: int, n_kv: int) -> None:
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


def test_batch_of_three_views_with_a_prefill_equals_each_alone() -> None:
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
    counter.reset()
    assert counter.records == [] and counter.n_steps == 0 and counter.total_bytes() == 0


@pytest.mark.parametrize("strategy", PREFILL_STRATEGIES)
@pytest.mark.parametrize(("n_heads", "n_kv", "window"), [(8, 2, None), (6, 3, None), (4, 1, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_dense_reference(
    strategy: str, n_heads: int, n_kv: int, window: int | None, dtype: torch.dtype
) -> None:
    """A later chunk over earlier context, both strategies, both dtypes: the fp32 path
    is exact to 1e-5, the bf16 path (the model dtype on CPU) close to the fp64 truth."""
    gen = torch.Generator().manual_seed(n_heads + n_kv)
    start, n = 150, 70
    q = torch.randn(n, n_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(n_kv, start + n, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(n_kv, start + n, HEAD_DIM, generator=gen).to(dtype)
    pos = torch.arange(start + n)[None, :]
    qpos = torch.arange(start, start + n)[:, None]
    keep = pos <= qpos
    if window is not None:
        keep &= pos > qpos - window
    ref = dense_reference(q, k.transpose(0, 1), v.transpose(0, 1), keep)
    got = prefill_attention(q, k, v, start, SCALE, window, strategy)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOL if dtype == torch.float32 else 3e-2
    assert (got.double() - ref).abs().max() < tol
    if window is not None:  # keys before the window may be left out entirely
        lo = start - window + 1
        part = prefill_attention(q, k[:, lo:], v[:, lo:], start, SCALE, window, strategy)
        assert (part.double() - ref).abs().max() < tol


def test_prefill_strategy_is_checked() -> None:
    world = make_world(4, 2)
    world.cache.allocate(1, 8)
    with pytest.raises(ValueError, match="strategy"):
        PagedAttention(world.cache, [SeqStep(1, 0, 8)], prefill_strategy="fast")


def test_prefill_rows_are_not_counted_and_ignore_views() -> None:
    world = make_world(4, 2)
    counter = ReadCounter()
    outs, refs, _ = world.step([(1, 20, [4])], counter)
    assert (outs[0].double() - refs[0]).abs().max() < TOL
    assert counter.records == []


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


def test_long_runs_take_the_per_head_path() -> None:
    """Runs longer than the batched-matmul threshold, and a ragged newest block."""
    world = make_world(8, 2, windows=(None, 700), num_blocks=200, block_size=16)
    world.step([(1, 1500, None)])
    counter = ReadCounter()
    outs, refs, steps = world.step([(1, 1, [0, 1, *range(30, 94)])], counter)
    for o, r in zip(outs, refs, strict=True):
        assert (o.double() - r).abs().max() < TOL
    assert counter.blocks_read(0, 1, 0) == tuple(steps[0].view)
    outs, refs, _ = world.step([(1, 1, None)])
    for o, r in zip(outs, refs, strict=True):
        assert (o.double() - r).abs().max() < TOL


def test_bf16_decode_is_close_to_fp64_reference() -> None:
    world = make_world(8, 2, windows=(None,), num_blocks=200, block_size=16, dtype=torch.bfloat16)
    world.step([(1, 900, None)])
    outs, refs, _ = world.step([(1, 1, [0, *range(10, 57)])])
    assert outs[0].dtype == torch.bfloat16
    err = (outs[0].double() - refs[0]).abs().max().item()
    assert err < 3e-2


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_decode_runs_split_any_way_equal_one_softmax(n_kv: int) -> None:
    """Many short whole-block runs (gathered), ragged and medium runs (flash kernel, or
    one batched matmul) and long runs (head by head), in any order, give one softmax
    over all their rows."""
    gen = torch.Generator().manual_seed(n_kv)
    kp = torch.randn(n_kv, 2112, HEAD_DIM, generator=gen)
    vp = torch.randn(n_kv, 2112, HEAD_DIM, generator=gen)
    q = torch.randn(4, HEAD_DIM, generator=gen)
    short = [(0, 16), (32, 48), (64, 128), (160, 176), (192, 208), (224, 240), (256, 272),
             (288, 320)]
    split = [(1500, 2090), *short, (329, 400), (401, 402), (900, 1499)]
    plan = RunPlan.from_rows(split, 16)
    assert plan.gather is not None
    assert plan.gather.tolist() == [0, 2, 4, 5, 6, 7, 10, 12, 14, 16, 18, 19]
    assert len(plan.slices) == 4 and plan.n_rows == sum(b - a for a, b in split)
    assert RunPlan.from_rows(split[:4], 16).gather is None  # a few runs stay slices
    keep = torch.zeros(2112, dtype=torch.bool)
    for r0, r1 in split:
        keep[r0:r1] = True
    ref = dense_reference(q, kp.transpose(0, 1), vp.transpose(0, 1), keep)
    got = decode_runs(kp, vp, q, split, SCALE)
    assert (got.double() - ref).abs().max() < TOL
    shuffled = decode_runs(kp, vp, q, split[::-1], SCALE)
    assert (shuffled.double() - ref).abs().max() < TOL


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 5000)],  # one long run: BLAS only
        [(0, 16), (700, 5100), (5200, 5301)],  # long + short: log-sum-exp merge
        [(32, 64), (96, 1000)],  # short only: flash partials merged
        [(100, 180)],  # one short run: the flash output as it is
    ],
    ids=["long", "mixed", "short", "single"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_and_their_merge_match_dense(rows, dtype) -> None:
    gen = torch.Generator().manual_seed(len(rows))
    n_kv = 2
    kp = torch.randn(n_kv, 5400, HEAD_DIM, generator=gen).to(dtype)
    vp = torch.randn(n_kv, 5400, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(8, HEAD_DIM, generator=gen).to(dtype)
    keep = torch.zeros(5400, dtype=torch.bool)
    for r0, r1 in rows:
        keep[r0:r1] = True
    ref = dense_reference(q, kp.transpose(0, 1), vp.transpose(0, 1), keep)
    got = decode_runs(kp, vp, q, rows, SCALE)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < (TOL if dtype == torch.float32 else 2e-2)


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
def test_random_views_match_dense_property(filled: World, data: hst.DataObject) -> None:
    sid = data.draw(hst.sampled_from([1, 2, 3]))
    length = filled.lengths[sid]
    n_blocks = -(-length // 4)
    others = data.draw(hst.sets(hst.integers(0, n_blocks - 2))) if n_blocks > 1 else set()
    view = sorted(others | {n_blocks - 1})
    counter = ReadCounter()
    outs, refs, _ = filled.step([(sid, 1, view)], counter, rewrite_last=True)
    assert (outs[0].double() - refs[0]).abs().max() < TOL
    assert counter.blocks_read(0, sid, 0) == tuple(view)
