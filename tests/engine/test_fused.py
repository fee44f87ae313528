"""The native RMSNorm and RoPE (``engine/models/fused.py``) against the torch code they
stand in for, and the cases where they must step aside."""

from __future__ import annotations

import pytest
import torch

from declattn.engine.models import fused
from declattn.engine.models.layers import RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(fused.layer_ops() is None, reason="no C++ compiler")


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (y * (1.0 + w.float())).to(x.dtype)
    return w * y.to(x.dtype)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 896), (37, 896), (5, 14, 64)])
def test_rms_norm_matches_torch(dtype, unit_offset, shape) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype)
    got = fused.rms_norm(x, w, 1e-6, unit_offset)
    want = torch_norm(x, w, 1e-6, unit_offset)
    assert got is not None and got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:  # the mean is summed in another order: last bits only
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # a few outputs one bf16 unit apart, none further
        differ = got != want
        assert differ.float().mean().item() < 0.01
        step = (want.float().abs() * 2**-7).clamp_min(2**-126)
        assert ((got.float() - want.float()).abs() <= step * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_matches_torch_exactly(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 14, 64, generator=g) * 3).to(dtype)
    cos, sin = torch.randn(9, 32, generator=g), torch.randn(9, 32, generator=g)
    got = fused.rotary(x, cos, sin)
    assert got is not None and torch.equal(got, torch_rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_reads_heads_in_place_from_a_wider_row(dtype) -> None:
    """The decode stack rotates q and k where the merged q/k/v matmul wrote them: each
    row's heads contiguous, the rows (q, k and v side by side) further apart."""
    g = torch.Generator().manual_seed(2)
    y = (torch.randn(5, (14 + 2 + 2) * 64, generator=g) * 3).to(dtype)
    q = y.as_strided((5, 14, 64), (y.stride(0), 64, 1))
    k = y.as_strided((5, 2, 64), (y.stride(0), 64, 1), 14 * 64)
    cos, sin = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    ops = fused.layer_ops()
    for x in (q, k):
        got = ops.rotary(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, torch_rotary(x.contiguous(), cos, sin))
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        ops.rotary(q.transpose(0, 1), cos, sin)


def test_the_model_blocks_go_through_it(monkeypatch) -> None:
    calls = []
    real_norm, real_rotary = fused.rms_norm, fused.rotary
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(fused, "rotary", lambda *a: calls.append("rotary") or real_rotary(*a))
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    q = torch.randn(3, 4, 64).to(torch.bfloat16)
    cos, sin = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(norm(x), real_norm(x, norm.weight, 1e-5, False))
        assert torch.equal(apply_rotary(q, cos, sin), torch_rotary(q, cos, sin))
    assert calls == ["norm", "rotary"]


def test_steps_aside_where_a_gradient_is_wanted() -> None:
    """The kernel has no backward: training must get the torch code and its gradients."""
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 16, requires_grad=True)
    assert fused.rms_norm(x, norm.weight, 1e-6, False) is None
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    q = torch.randn(2, 3, 16, requires_grad=True)
    assert fused.rotary(q, torch.randn(2, 8), torch.randn(2, 8)) is None
    with torch.no_grad():
        assert fused.rms_norm(x, norm.weight, 1e-6, False) is not None


def test_steps_aside_for_what_it_does_not_take() -> None:
    with torch.no_grad():
        x16 = torch.randn(2, 8).half()
        assert fused.rms_norm(x16, torch.ones(8).half(), 1e-6, False) is None
        x = torch.randn(2, 8).bfloat16()
        assert fused.rms_norm(x, torch.ones(8), 1e-6, False) is None  # weight in fp32
        assert (
            fused.rotary(torch.randn(2, 8).bfloat16(), torch.randn(2, 4), torch.randn(2, 4)) is None
        )


def test_bad_shapes_are_one_line_errors() -> None:
    ops = fused.layer_ops()
    with pytest.raises(RuntimeError, match="rms_norm: contiguous x"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="rotary: cos and sin"):
        ops.rotary(torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(2, 3))
