"""Packed linear layers multiply like the weight they stand for; the kernels' conventions
(int4: ``(q - 8) * scale + zero`` per 32-group; int8: ``q * scale`` per row) are checked
here against a plain matmul, so a change in torch's packing shows up as a failing test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from declattn.engine.quant.blocks import group_codes
from declattn.engine.quant.linear import Int4Linear, Int8Linear
from declattn.engine.quant.requant import int4_exact, int4_rounded, int8_rounded

BF16 = torch.bfloat16


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    y = x.float() @ w.float().t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("rows", [64, 40])  # 40: not a multiple of 16, padded inside
def test_int4_convention_and_padding(rows):
    g = torch.Generator().manual_seed(rows)
    cols = 128
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.05 + 0.01
    zero = torch.randn(rows, cols // 32, generator=g) * 0.1
    bias = torch.randn(rows, generator=g).to(BF16)
    layer = Int4Linear.from_codes(codes, scale, zero, 32, torch.float32, bias.float())
    expanded = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    w = (codes.float() - 8) * expanded(scale) + expanded(zero)
    x = torch.randn(5, 3, cols, generator=g)
    y = layer(x)
    assert y.shape == (5, 3, rows)
    torch.testing.assert_close(y, _reference(x, w, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.dequantized(), w, rtol=1e-5, atol=1e-5)


def test_int8_convention():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    layer = Int8Linear.from_float(w, BF16)
    x = torch.randn(4, 96, generator=g).to(BF16)
    y = layer(x)
    assert y.dtype == BF16
    ref = _reference(x, layer.dequantized())
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    # per-row rounding: at most half a step of that row's scale
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantized() - w).abs() <= 0.51 * step + 1e-6).all()


def test_int4_exact_is_the_gguf_weight_up_to_bf16_scales():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        codes = group_codes(quantize(w, kind), kind, w.shape)
        layer = int4_exact(codes, BF16)
        want = torch.from_numpy(codes.dequantize())
        err = (layer.dequantized() - want).abs()
        step = torch.from_numpy(np.abs(codes.scale)).repeat_interleave(32, dim=1)
        # scale and zero rounded to bf16 (8 bits): well under a tenth of a code step
        assert (err <= 0.1 * step).all(), float((err / step).max())


def test_rounded_layers_stay_within_their_steps():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    four = int4_rounded(w, BF16).dequantized().numpy()
    groups = w.reshape(32, -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / 15
    err = np.abs(four - w).reshape(32, -1, 32)
    assert (err <= 0.6 * step[..., None] + 1e-3).all()
    eight = int8_rounded(w, BF16).dequantized().numpy()
    assert np.abs(eight - w).max() < np.abs(four - w).max() / 4


def test_shapes_the_kernels_refuse_are_refused():
    with pytest.raises(ValueError, match="group"):
        Int4Linear.from_codes(
            torch.zeros(16, 48, dtype=torch.int64), torch.ones(16, 1), torch.zeros(16, 1), 48, BF16
        )
    with pytest.raises(ValueError, match="multiple of 8"):
        Int8Linear.from_float(torch.randn(16, 90), BF16)


def test_packed_tensors_at_any_offset_are_aligned_before_torchs_kernels_see_them():
    """Views into a safetensors file sit at any offset; torch's int8 kernel crashed on
    codes 56 bytes past a 64-byte boundary (AVX-512). The layers hold aligned copies,
    and the result is the one of the aligned tensors."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randint(-127, 127, (64 * 64 + 64,), dtype=torch.int8, generator=gen)
    codes = buf[56 : 56 + 64 * 64].view(64, 64)
    scales = torch.rand(200, generator=gen).bfloat16()[28 : 28 + 64]
    assert codes.data_ptr() % 64 and scales.data_ptr() % 64
    layer = Int8Linear(codes, scales)
    assert layer.codes.data_ptr() % 64 == 0 and layer.scales.data_ptr() % 64 == 0
    x = torch.randn(20, 64, generator=gen).bfloat16()
    want = Int8Linear(codes.clone(), scales.clone())(x)
    assert torch.equal(layer(x), want)
