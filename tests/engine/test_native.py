"""The fused decode kernel against a plain gather + softmax, and how it is built.

The reference gathers the kept rows of each query row with ``index_select`` and runs an
fp64 softmax: nothing shared with the kernel but the inputs. Views are random sets of
blocks over a random physical layout; the kernel must also never look outside them
(rows it must not read are NaN) and must give the same answer however its work is
split across threads.
"""

from __future__ import annotations

import os
import platform
import random

import pytest
import torch

from declattn.engine import native
from declattn.engine.decode import RunBatch, decode_batch
from declattn.engine.runs import RunPlan, plan_runs

BLOCK = 16
# One rounding of outputs of magnitude < 4 to the dtype (half an ulp at 4, with margin).
ROUNDING = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def op():
    """The kernel; a machine with a C++ compiler must build it."""
    got = native.decode_op()
    if got is None:
        if os.environ.get(native.ENV_SWITCH) == "torch":
            pytest.skip(f"{native.ENV_SWITCH}=torch")
        pytest.fail("the fused decode kernel did not build (see the warning)")
    return got


def gather_softmax(kp, vp, q, rows, scale) -> torch.Tensor:
    """``q [H, D]`` over pool rows ``rows`` (ranges), fp64: gather, then softmax."""
    idx = torch.cat([torch.arange(a, b) for a, b in rows])
    n_kv = kp.shape[0]
    k = kp.index_select(1, idx).double()
    v = vp.index_select(1, idx).double()
    qg = q.double().reshape(n_kv, -1, q.shape[-1]) * scale
    p = torch.softmax(torch.einsum("hgd,hld->hgl", qg, k), dim=-1)
    return torch.einsum("hgl,hld->hgd", p, v).reshape(q.shape)


def random_plan(rng: random.Random, n_blocks: int, pool_blocks: int, length: int) -> RunPlan:
    """A sequence of ``length`` positions whose blocks sit at random physical places,
    viewed through a random subset of its blocks (always the newest one)."""
    table = rng.sample(range(pool_blocks), n_blocks)
    keep = sorted({b for b in range(n_blocks - 1) if rng.random() < 0.3} | {n_blocks - 1})
    return plan_runs(table, keep, 0, length, BLOCK, "cpu", None)


SHAPES = [(14, 2, 64), (8, 2, 16), (9, 3, 64), (4, 1, 256), (8, 8, 128), (16, 1, 64), (5, 1, 40)]


@pytest.mark.parametrize(("n_heads", "n_kv", "dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_views_match_gather_softmax(op, n_heads, n_kv, dim, dtype) -> None:
    """A batch of rows, each with its own random view, in one call; pools in ``dtype``.

    With fp32 queries the output is fp32 and all that is left against the fp64
    reference is fp32 accumulation; with queries in the pool's dtype (the model's), the
    output comes back in that dtype, rounded once."""
    rng = random.Random(n_heads * 1000 + dim)
    gen = torch.Generator().manual_seed(n_heads + dim)
    pool_blocks = 96
    kp = torch.randn(n_kv, pool_blocks * BLOCK, dim, generator=gen).to(dtype)
    vp = torch.randn(n_kv, pool_blocks * BLOCK, dim, generator=gen).to(dtype)
    plans = []
    for _ in range(4):
        n_blocks = rng.randrange(1, 40)
        plans.append(random_plan(rng, n_blocks, pool_blocks, n_blocks * BLOCK - rng.randrange(16)))
    q = torch.randn(len(plans), n_heads, dim, generator=gen)
    scale = dim**-0.5
    for q_dtype, tol in ((torch.float32, 2e-6), (dtype, ROUNDING[dtype])):
        qd = q.to(q_dtype)
        got = decode_batch(kp, vp, qd, RunBatch.of(plans), scale, kernel="native")
        assert got.dtype == q_dtype and got.shape == q.shape
        for b, plan in enumerate(plans):
            ref = gather_softmax(kp, vp, qd[b], plan.rows.tolist(), scale)
            assert (got[b].double() - ref).abs().max() < tol


def _linux_grants_amx() -> bool:
    """Linux hands out AMX on request from 5.16 on."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (5, 16)


def test_a_cpu_with_avx512_bf16_gets_the_bf16_path(op) -> None:
    """The shapes above run the AVX-512 BF16 path for bf16 queries and pools of head_dim
    32/64/128/256 where the CPU has it, by AMX where it has that too: a build that
    silently lost either would still pass them on a slower path."""
    flags = native.cpu_flags()
    lib = native.library()
    assert lib is not None
    assert native.decode_bf16_path() == ("avx512_bf16" in lib.isa)
    assert set(lib.isa) - {"openmp"} <= flags  # never code this CPU cannot run
    ways = ("amx", "vdpbf16ps", "fma") if native.decode_bf16_path() else ("",)
    assert native.decode_scoring() in ways
    if native.decode_bf16_path() and {"amx_bf16", "amx_tile"} <= set(flags):
        assert (native.decode_scoring() == "amx") == _linux_grants_amx()


@pytest.mark.parametrize(("n_heads", "n_kv", "dim"), [(14, 2, 64), (4, 1, 32), (8, 2, 128),
                                                   (4, 1, 256), (16, 1, 64)])
def test_every_way_of_scoring_matches_gather_softmax(op, n_heads, n_kv, dim) -> None:
    """The BF16 path scores keys by ``vdpbf16ps``, by fp32 FMAs or by AMX tiles (the CPU
    picks; the op's ``scoring`` forces one): each matches the reference over a random
    view, and the machine's choice is one of them, bit for bit. On a CPU without the path
    all but AMX are the portable path; AMX runs only where the CPU and OS have it."""
    rng = random.Random(dim)
    gen = torch.Generator().manual_seed(dim)
    kp = torch.randn(n_kv, 64 * BLOCK, dim, generator=gen).bfloat16()
    vp = torch.randn(n_kv, 64 * BLOCK, dim, generator=gen).bfloat16()
    plan = random_plan(rng, 40, 64, 40 * BLOCK - 5)
    q = torch.randn(1, n_heads, dim, generator=gen).bfloat16()
    batch = RunBatch.of([plan])
    got = {name: op(q, kp, vp, batch.runs, batch.offsets, dim**-0.5, 1, code)
           for name, code in _ways(op).items()}
    ref = gather_softmax(kp, vp, q[0], plan.rows.tolist(), dim**-0.5)
    for name, out in got.items():
        assert (out[0].double() - ref).abs().max() < ROUNDING[torch.bfloat16], name
    mine = native.decode_scoring() or "fma"
    assert torch.equal(got["machine"], got[mine])


def _amx(op) -> bool:
    return native.decode_scoring() == "amx"


def _ways(op) -> dict[str, int]:
    """The ``scoring`` arguments this machine runs (AMX only where it has it)."""
    return {n: c for n, c in native.SCORINGS.items() if n != "amx" or _amx(op)}


def test_an_unknown_scoring_is_refused(op) -> None:
    kp = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    args = (q, kp, kp, torch.tensor([[0, 16]]), torch.tensor([0, 1]), 1.0, 1)
    with pytest.raises(RuntimeError, match="scoring must be 0, 1, 2 or 3"):
        op(*args, 4)
    if not _amx(op):
        with pytest.raises(RuntimeError, match="scoring 3 .AMX.: this CPU, build or OS has no AMX"):
            op(*args, native.SCORINGS["amx"])


def test_amx_items_after_a_larger_group_read_nothing_of_it(op) -> None:
    """The AMX path's scratch lives across work items and is not cleared between them: the
    rows of the weights and the columns of Q^T past an item's group hold an earlier item's
    values. Here those are NaN (an earlier item's heads past the group have NaN queries),
    and each later item, on the same thread, must still match the reference."""
    if not _amx(op):
        pytest.skip("no AMX on this CPU, build or OS")
    gen = torch.Generator().manual_seed(5)
    kp = torch.randn(1, 512, 64, generator=gen).bfloat16()
    vp = torch.randn(1, 512, 64, generator=gen).bfloat16()
    runs, offsets = torch.tensor([[3, 300]]), torch.tensor([0, 1])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for group in (16, 2, 7, 1, 16, 3):
            q = torch.randn(1, group, 64, generator=gen).bfloat16()
            if group == 16:
                q[0, 1:] = float("nan")
            got = op(q, kp, vp, runs, offsets, 0.125, 1, native.SCORINGS["amx"])[0]
            ref = gather_softmax(kp, vp, q[0], runs.tolist(), 0.125)
            finite = 1 if group == 16 else group
            assert (got[:finite].double() - ref[:finite]).abs().max() < ROUNDING[torch.bfloat16]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 4, 8])  # two KV heads: split from 4 threads
@pytest.mark.parametrize("min_split", [1, 7, 100_000])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_work_split_does_not_change_the_answer(op, threads: int, min_split: int,
                                               q_dtype: torch.dtype) -> None:
    """Rows split across threads are merged by their maxima: the same softmax (bf16
    queries: the bf16 path where the CPU has it)."""
    gen = torch.Generator().manual_seed(3)
    kp = torch.randn(2, 4096, 64, generator=gen).to(torch.bfloat16)
    vp = torch.randn(2, 4096, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 14, 64, generator=gen).to(q_dtype)
    runs = torch.tensor([[0, 16], [100, 1337], [2048, 2049], [3000, 4096]])
    offsets = torch.tensor([0, 4])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = op(q, kp, vp, runs, offsets, 1.0, min_split)
    finally:
        torch.set_num_threads(before)
    ref = gather_softmax(kp, vp, q[0], runs.tolist(), 1.0)[None]
    tol = 1e-5 if q_dtype == torch.float32 else ROUNDING[q_dtype]
    assert (got.double() - ref).abs().max() < tol  # unscaled q: sharp, large scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_outside_the_runs_are_never_read(op, dtype) -> None:
    """Every pool row the plan leaves out is NaN; one read of one would poison the output.
    bf16: every way of scoring (a tile's padding rows and the rows gathered where 16 rows
    are not one run must come from the view too)."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    plan = random_plan(rng, 50, 120, 50 * BLOCK - 3)
    kp = torch.full((2, 120 * BLOCK, 64), float("nan"))
    vp = torch.full((2, 120 * BLOCK, 64), float("nan"))
    for a, b in plan.rows.tolist():
        kp[:, a:b] = torch.randn(2, b - a, 64, generator=gen)
        vp[:, a:b] = torch.randn(2, b - a, 64, generator=gen)
    kp, vp = kp.to(dtype), vp.to(dtype)
    q = torch.randn(1, 14, 64, generator=gen).to(dtype)
    ref = gather_softmax(kp, vp, q[0], plan.rows.tolist(), 0.125)
    batch = RunBatch.of([plan])
    tol = 2e-6 if dtype == torch.float32 else ROUNDING[dtype]
    for way in _ways(op).values() if dtype == torch.bfloat16 else [0]:
        got = op(q, kp, vp, batch.runs, batch.offsets, 0.125, 1, way)
        assert torch.isfinite(got).all(), way
        assert (got[0].double() - ref).abs().max() < tol


def test_empty_runs_are_skipped(op) -> None:
    gen = torch.Generator().manual_seed(7)
    kp = torch.randn(2, 256, 64, generator=gen)
    vp = torch.randn(2, 256, 64, generator=gen)
    q = torch.randn(1, 14, 64, generator=gen)
    rows = [[0, 0], [3, 40], [40, 40], [40, 40], [100, 101], [256, 256]]
    got = op(q, kp, vp, torch.tensor(rows), torch.tensor([0, len(rows)]), 0.125, 8)
    ref = gather_softmax(kp, vp, q[0], [r for r in rows if r[1] > r[0]], 0.125)
    assert (got[0].double() - ref).abs().max() < 2e-6


def test_bad_runs_are_refused(op) -> None:
    kp = torch.zeros(2, 64, 64)
    q = torch.zeros(1, 14, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, kp, kp, torch.tensor([[0, 65]]), torch.tensor([0, 1]), 1.0, 256)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        narrow = kp[..., :60].contiguous()
        op(q[..., :60].contiguous(), narrow, narrow, torch.tensor([[0, 8]]),
           torch.tensor([0, 1]), 1.0, 256)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(torch.zeros(1, 13, 64), kp, kp, torch.tensor([[0, 8]]), torch.tensor([0, 1]), 1.0, 256)


