"""Merged GGUF projections (q/k/v, gate/up) give what the separate layers give, bit for bit.

The merged call rounds the row to int8 once and walks every part's tiles in one range;
a part's output read from the wrong offset, a tile of one part multiplied in another's
format, or a bias added to the wrong slice changes the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_samples import gguf_blocks

from declattn.engine.dense import DenseAttention
from declattn.engine.loader import load_model
from declattn.engine.models.decoder import DecodeRoute
from declattn.engine.models.layers import MLP, Attention
from declattn.engine.quant import kernel
from declattn.engine.quant.fuse import fuse_gguf_projections
from declattn.engine.quant.linear import GEMM_ROWS, GGUFConcat, GGUFLinear
from declattn.engine.registry import resolve_model

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def ops():
    found = kernel.gguf_ops()
    if found is None:
        pytest.skip("the GGUF kernel is not available")
    return found


def _layer(kind: Q, rows: int, cols: int, seed: int, bias: bool) -> GGUFLinear:
    raw = gguf_blocks(kind, rows, cols, np.random.default_rng(seed))
    layer = GGUFLinear(torch.from_numpy(raw.copy()), int(kind), cols)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(rows), requires_grad=False)
    return layer


@pytest.mark.parametrize("m", [1, 3, GEMM_ROWS])  # decode rows; a prefill chunk
def test_merged_layer_equals_its_parts_side_by_side(ops, m):
    """Mixed formats and layouts (regrouped Q5_0, Q8_0, Q4_K), rows not a multiple of the
    tile (50), and a part without a bias between two with one."""
    parts = [
        _layer(Q.Q5_0, 96, 512, 1, bias=True),
        _layer(Q.Q8_0, 50, 512, 2, bias=False),
        _layer(Q.Q4_K, 40, 512, 3, bias=True),
    ]
    fused = GGUFConcat(parts)
    assert fused.out_features == 186
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
        want = torch.cat([p(x) for p in parts], dim=-1)
        got = fused(x)
        assert got.dtype == want.dtype and torch.equal(got, want), (m, dtype)


def test_merged_call_refuses_bad_inputs_in_one_line(ops):
    a = _layer(Q.Q8_0, 16, 512, 1, bias=False)
    x = torch.randn(1, 512)
    with pytest.raises(RuntimeError, match="one type per weight"):
        ops.gguf_linear_cat(x, [a.blocks, a.blocks], [a.kernel_type])
    with pytest.raises(RuntimeError, match="do not match"):
        ops.gguf_linear_cat(torch.randn(1, 480), [a.blocks], [a.kernel_type])
    with pytest.raises(ValueError, match="same input width"):
        GGUFConcat([a, _layer(Q.Q8_0, 16, 256, 2, bias=False)])


def test_a_loaded_gguf_is_merged_and_gives_the_unmerged_logits():
    """SmolLM2's 30 layers: q/k/v and gate/up each one call. A prompt shorter than
    ``GEMM_ROWS`` goes through the decode kernel, where the merged call is used."""
    loaded = load_model(resolve_model("smollm2-135m"), device="cpu")
    model = loaded.model
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert all(isinstance(a.qkv_proj, GGUFConcat) for a in attns) and len(attns) == 30
    assert all(isinstance(m.gate_up_proj, GGUFConcat) for m in mlps)
    ids = torch.tensor(loaded.tokenizer("The vault code of the north tower is").input_ids)
    assert len(ids) < GEMM_ROWS
    with torch.inference_mode():
        merged = model.logits(model(ids, torch.arange(len(ids)), DenseAttention()))
        for a in attns:
            a.qkv_proj = None
        for m in mlps:
            m.gate_up_proj = None
        model.use_route(DecodeRoute())  # its runner refers to the merged layers
        separate = model.logits(model(ids, torch.arange(len(ids)), DenseAttention()))
    assert torch.equal(merged, separate)
    assert fuse_gguf_projections(model) == 60  # merging again, after the change, works


def test_layers_that_are_not_all_gguf_stay_as_they_are():
    loaded = load_model(resolve_model("smollm2-135m"), device="cpu", quantize=False)
    assert fuse_gguf_projections(loaded.model) == 0
    assert all(a.qkv_proj is None for a in loaded.model.modules() if isinstance(a, Attention))
