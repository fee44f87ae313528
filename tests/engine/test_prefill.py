"""Prefill attention over earlier context against the dense reference and the masked path;
the fp32 fallback where torch's bf16 kernel cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from paged_world import HEAD_DIM, SCALE, TOL, dense_reference

import declattn.engine.prefill as prefill_module
from declattn.engine.prefill import (
    masked_prefill_attention,
    prefill_attention,
    viewed_prefill_attention,
)


@pytest.mark.parametrize("attend", [prefill_attention, masked_prefill_attention],
                         ids=["engine", "masked"])
@pytest.mark.parametrize(("n_heads", "n_kv", "window"), [(8, 2, None), (6, 3, None), (4, 1, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_dense_reference(
    attend, n_heads: int, n_kv: int, window: int | None, dtype: torch.dtype
) -> None:
    """A later chunk over earlier context, both dtypes, through the engine's path (the
    context-then-chunk merge where there is no window) and the masked path: the fp32
    path is exact to 1e-5, the bf16 path (the model dtype on CPU) close to the fp64
    truth."""
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
    got = attend(q, k, v, start, SCALE, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOL if dtype == torch.float32 else 3e-2
    assert (got.double() - ref).abs().max() < tol
    if window is not None:  # keys before the window may be left out entirely
        lo = start - window + 1
        part = attend(q, k[:, lo:], v[:, lo:], start, SCALE, window)
        assert (part.double() - ref).abs().max() < tol


def _torch_failing_in_bf16(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """torch's SDPA as the prefill calls it, raising ``message`` on bf16 inputs (as torch
    2.13 does on an AMX CPU with ``ATEN_CPU_CAPABILITY=avx2``)."""
    real = prefill_module.F.scaled_dot_product_attention

    def sdpa(q, *args, **kwargs):
        if q.dtype == torch.bfloat16:
            raise RuntimeError(message)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(prefill_module.F, "scaled_dot_product_attention", sdpa)


def _bf16_prompt(n: int = 40, heads: int = 8, kv: int = 2):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(n, heads, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(kv, n, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(kv, n, HEAD_DIM, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("call", ["whole", "windowed", "viewed"])
def test_torch_bf16_failure_falls_back_to_fp32_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Where torch's bf16 attention kernel refuses to run (pack_vnni2), each entry point
    redoes the attention in fp32, returns bf16, and warns with the cause and the fix."""
    q, k, v = _bf16_prompt()
    views = [None] * 20 + [(0, 2)] * 20
    attend = {
        "whole": lambda q, k, v: prefill_attention(q, k, v, 0, SCALE, None),
        "windowed": lambda q, k, v: prefill_attention(q, k, v, 0, SCALE, 16),
        "viewed": lambda q, k, v: viewed_prefill_attention(q, k, v, 0, SCALE, views, 16),
    }[call]
    expected = attend(q.float(), k.float(), v.float()).bfloat16()
    _torch_failing_in_bf16(monkeypatch, "pack_vnni2 is only supported when avx512 is supported")
    with pytest.warns(RuntimeWarning, match="ATEN_CPU_CAPABILITY"):
        got = attend(q, k, v)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_other_torch_failures_are_raised_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only torch's known bf16 failure falls back; any other error surfaces unchanged."""
    q, k, v = _bf16_prompt()
    _torch_failing_in_bf16(monkeypatch, "out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        prefill_attention(q, k, v, 0, SCALE, None)


def _amx_cpu_with_avx512_aten() -> bool:
    try:
        flags = next(
            line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return "amx_tile" in flags.split() and torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.skipif(not _amx_cpu_with_avx512_aten(), reason="needs an AMX CPU (the failure "
                    "only happens there)")
def test_prefill_runs_with_aten_capped_at_avx2_on_an_amx_cpu() -> None:
    """The real failure: with ``ATEN_CPU_CAPABILITY=avx2`` on an AMX CPU torch's bf16
    attention raises; the prefill falls back, matches fp32, and warns once."""
    code = (
        "import warnings, torch\n"
        "from declattn.engine.prefill import prefill_attention\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q = torch.randn(100, 14, 64, generator=g).bfloat16()\n"
        "k = torch.randn(2, 100, 64, generator=g).bfloat16()\n"
        "v = torch.randn(2, 100, 64, generator=g).bfloat16()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    got = prefill_attention(q, k, v, 0, 0.125, None)\n"
        "ref = prefill_attention(q.float(), k.float(), v.float(), 0, 0.125, None).bfloat16()\n"
        "assert torch.equal(got, ref)\n"
        "print(len(w), 'ATEN_CPU_CAPABILITY' in str(w[0].message))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "True"]
