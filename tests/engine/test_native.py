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
import shutil
import warnings
from pathlib import Path

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
    flags = native._cpu_flags().split()
    assert native.decode_bf16_path() == ("avx512_bf16" in flags)
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


def test_a_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    native.decode_op.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="install a C\\+\\+ compiler") as caught:
            assert native.decode_op() is None
            assert native.decode_op() is None  # cached: no second build, no second warning
        assert len(caught) == 1
        assert list(tmp_path.glob("declattn/kernels/*/decode_attn.log"))
        monkeypatch.setenv(native.ENV_SWITCH, "torch")
        native.decode_op.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # chosen on purpose: no warning
            assert native.decode_op() is None
        monkeypatch.setenv(native.ENV_SWITCH, "fast")
        native.decode_op.cache_clear()
        with pytest.raises(ValueError, match="native"):
            native.decode_op()
    finally:
        native.decode_op.cache_clear()


def test_build_key_follows_source_torch_and_cpu(monkeypatch) -> None:
    key = native.build_key("c++")
    assert key == native.build_key("c++") and key != native.build_key("clang++")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "sse2")
    assert native.build_key("c++") != key


def test_build_key_follows_the_headers_beside_the_source(tmp_path) -> None:
    """A kernel split into a source and headers is rebuilt when a header changes."""
    source = tmp_path / "k.cpp"
    source.write_text('#include "k.h"\n')
    header = tmp_path / "k.h"
    header.write_text("int a = 1;\n")
    key = native.build_key("c++", source)
    header.write_text("int a = 2;\n")
    assert native.build_key("c++", source) != key


TINY_OP = """#include <torch/library.h>
int64_t twice(int64_t x) { return 2 * x; }
TORCH_LIBRARY(declattn_test_no_openmp, m) { m.def("twice(int x) -> int", twice); }
"""


def fake_compiler(tmp_path: Path, fails_always: bool = False) -> Path:
    """A ``CXX`` that appends its flags' OpenMP-ness to ``calls`` and fails with clang's
    message on ``-fopenmp`` (or on everything), else runs the real compiler."""
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler")
    script = tmp_path / "cxx"
    script.write_text(
        "#!/bin/sh\n"
        "omp=plain\n"
        'for a in "$@"; do [ "$a" = -fopenmp ] && omp=openmp; done\n'
        f'echo $omp >> "{tmp_path}/calls"\n'
        f"if [ $omp = openmp ] || {str(fails_always).lower()}; then\n"
        "  echo \"clang: error: unsupported option '$omp'\" >&2; exit 1\n"
        "fi\n"
        f'exec "{real}" "$@"\n'
    )
    script.chmod(0o755)
    return script


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().split() if path.exists() else []


def test_a_compiler_without_openmp_builds_on_one_thread(tmp_path, monkeypatch) -> None:
    """The build with -fopenmp fails, the one without loads, with one warning per call.

    Every call that hands out the one-thread library warns once (``load_op`` caches the
    op, so that is once per kernel per process): a later process must hear of the cost
    too, but neither asks the compiler to fail again while the failed log is kept."""
    cxx = fake_compiler(tmp_path)
    monkeypatch.setenv("CXX", str(cxx))
    source = tmp_path / "tiny_op.cpp"
    source.write_text(TINY_OP)
    out = tmp_path / "kernels"
    with pytest.warns(RuntimeWarning) as caught:
        lib = native.build_library(source, directory=out)
    assert lib.exists() and calls(tmp_path) == ["openmp", "plain"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "-fopenmp" in message and "one thread" in message and "libomp" in message
    assert "unsupported option" in message and "CXX" in message
    assert lib.parent.name == native.build_key(str(cxx), source, native.CFLAGS_NO_OPENMP)
    assert lib.parent.name != native.build_key(str(cxx), source)
    torch.ops.load_library(str(lib))
    assert torch.ops.declattn_test_no_openmp.twice(21) == 42

    with pytest.warns(RuntimeWarning, match="one thread") as caught:
        assert native.build_library(source, directory=out) == lib  # a later process
    assert len(caught) == 1 and calls(tmp_path) == ["openmp", "plain"]  # no compile at all

    log = out / native.build_key(str(cxx), source) / "tiny_op.log"
    assert str(log) in message
    log.unlink()  # the fix the warning names: OpenMP is tried again (here: fails again)
    with pytest.warns(RuntimeWarning, match="one thread") as caught:
        assert native.build_library(source, directory=out) == lib
    assert len(caught) == 1 and calls(tmp_path) == ["openmp", "plain", "openmp"]


def test_a_build_failing_with_and_without_openmp_raises(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, fails_always=True)))
    source = tmp_path / "tiny_op.cpp"
    source.write_text(TINY_OP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error says it all: no one-thread warning
        with pytest.raises(native.KernelBuildError, match="unsupported option") as raised:
            native.build_library(source, directory=tmp_path / "kernels")
    message = str(raised.value)
    assert "\n" not in message and "log: " in message
    assert Path(message.split("log: ")[1]).exists()
    assert calls(tmp_path) == ["openmp", "plain"]
