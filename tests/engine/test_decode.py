"""Both decode paths (the fused kernel and the torch fallback): any split of the kept
rows into runs gives one softmax over them, through ``decode_runs`` and through
``PagedAttention``; asked to, bit for bit the same wherever the blocks sit."""

from __future__ import annotations

import pytest
import torch
from paged_world import HEAD_DIM, SCALE, TOL, dense_reference, make_world

from declattn.engine.decode import RunBatch, decode_batch, decode_runs
from declattn.engine.reads import ReadCounter
from declattn.engine.runs import RunPlan, plan_runs


def test_long_runs_take_the_per_head_path(kernel: str) -> None:
    """Runs longer than the fallback's batched-matmul threshold, and a ragged newest
    block."""
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


def test_bf16_decode_is_close_to_fp64_reference(kernel: str) -> None:
    world = make_world(8, 2, windows=(None,), num_blocks=200, block_size=16, dtype=torch.bfloat16)
    world.step([(1, 900, None)])
    outs, refs, _ = world.step([(1, 1, [0, *range(10, 57)])])
    assert outs[0].dtype == torch.bfloat16
    err = (outs[0].double() - refs[0]).abs().max().item()
    assert err < 3e-2


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_decode_runs_split_any_way_equal_one_softmax(n_kv: int, kernel: str) -> None:
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
    assert RunPlan.from_rows(split, 16).pieces.gather is not None  # the fallback gathers
    keep = torch.zeros(2112, dtype=torch.bool)
    for r0, r1 in split:
        keep[r0:r1] = True
    ref = dense_reference(q, kp.transpose(0, 1), vp.transpose(0, 1), keep)
    got = decode_runs(kp, vp, q, split, SCALE, kernel=kernel)
    assert (got.double() - ref).abs().max() < TOL
    shuffled = decode_runs(kp, vp, q, split[::-1], SCALE, kernel=kernel)
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
def test_decode_kernels_and_their_merge_match_dense(rows, dtype, kernel: str) -> None:
    gen = torch.Generator().manual_seed(len(rows))
    n_kv = 2
    kp = torch.randn(n_kv, 5400, HEAD_DIM, generator=gen).to(dtype)
    vp = torch.randn(n_kv, 5400, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(8, HEAD_DIM, generator=gen).to(dtype)
    keep = torch.zeros(5400, dtype=torch.bool)
    for r0, r1 in rows:
        keep[r0:r1] = True
    ref = dense_reference(q, kp.transpose(0, 1), vp.transpose(0, 1), keep)
    got = decode_runs(kp, vp, q, rows, SCALE, kernel=kernel)
    assert got.dtype == dtype
    assert (got.double() - ref).abs().max() < (TOL if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_blocks_sit_does_not_change_the_answer(kernel: str, dtype) -> None:
    """The same logical K/V, once in consecutive blocks and once scattered with later
    blocks below earlier ones (a freed block reused), gives bit-equal attention, for a
    full view and a DA view: rows are summed in logical order whatever the placement.
    What batch-invariant mode rests on, since which blocks a sequence gets depends on
    what else runs beside it."""
    gen = torch.Generator().manual_seed(11)
    bs, n_kv, dim, n_blocks = 16, 3, 64, 23
    length = n_blocks * bs - 5
    k = torch.randn(n_kv, n_blocks * bs, dim, generator=gen).to(dtype)
    v = torch.randn(n_kv, n_blocks * bs, dim, generator=gen).to(dtype)
    q = torch.randn(1, 9, dim, generator=gen).to(dtype)
    scattered = [40, 41, 42, 7, 8, 60, 3, 4, 5, 6, 50, 51, 52, 53, 1, 0, 30, 31, 32, 33,
                 34, 20, 10]
    got = []
    for table in (list(range(n_blocks)), scattered):
        kp = torch.full((n_kv, 64 * bs, dim), float("nan"), dtype=dtype)
        vp = kp.clone()
        for logical, phys in enumerate(table):
            kp[:, phys * bs : (phys + 1) * bs] = k[:, logical * bs : (logical + 1) * bs]
            vp[:, phys * bs : (phys + 1) * bs] = v[:, logical * bs : (logical + 1) * bs]
        for keep in (range(n_blocks), [0, 1, 2, 5, 9, 10, 14, 15, 16, 20, 22]):
            batch = RunBatch.of([plan_runs(table, keep, 0, length, bs, "cpu", None)])
            got.append(decode_batch(kp, vp, q, batch, dim**-0.5, placement_invariant=True))
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3])
