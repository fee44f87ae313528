"""Prefill attention over earlier context against the dense reference and the masked path."""

from __future__ import annotations

import pytest
import torch
from paged_world import HEAD_DIM, SCALE, TOL, dense_reference

from declattn.engine.prefill import masked_prefill_attention, prefill_attention


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
