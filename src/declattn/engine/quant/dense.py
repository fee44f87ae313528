"""Pack a dense model's linear layers in place, rounding its float weights.

A GGUF's layers are packed from its own codes (``gguf_weights``); a model that has only
float weights (a Hugging Face checkpoint, a test model) can still run the packed path
by rounding them once, to int8 per row or int4 per group of 32. The engine's parity
tests use this to run on packed layers.
"""

from __future__ import annotations

import torch
from torch import nn

from declattn.engine.models.decoder import Decoder
from declattn.engine.quant.gguf_weights import TIED_HEAD
from declattn.engine.quant.linear import QuantLinear, int4_fits, int8_fits
from declattn.engine.quant.requant import int4_rounded, int8_rounded
from declattn.engine.quant.store import install


def _pack(w: torch.Tensor, kind: str, dtype: torch.dtype) -> QuantLinear | None:
    rows, cols = w.shape
    arr = w.detach().float().cpu().numpy()
    if kind == "int4" and int4_fits(rows, cols):
        return int4_rounded(arr, dtype)
    if int8_fits(rows, cols):
        return int8_rounded(arr, dtype)
    return None


def pack_dense(model: Decoder, kind: str = "int8", dtype: torch.dtype | None = None) -> Decoder:
    """Replace every ``nn.Linear`` of ``model`` (and a tied output projection) by a packed
    layer of ``kind`` (``"int8"`` or ``"int4"``); shapes no kernel takes stay dense.
    ``dtype`` (default: the embedding's) is that of the activations; the model's float
    tensors are cast to it."""
    if kind not in ("int4", "int8"):
        raise ValueError(f"kind must be 'int4' or 'int8', got {kind!r}")
    dt = dtype or model.embed.weight.dtype
    layers: dict[str, QuantLinear] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            packed = _pack(module.weight, kind, dt)
            if packed is not None:
                layers[name] = packed
    if model.lm_head is None:
        packed = _pack(model.embed.weight, kind, dt)
        if packed is not None:
            layers[TIED_HEAD] = packed
    biases = {n: model.get_submodule(n).bias for n in layers if n != TIED_HEAD}
    install(model, layers)
    for name, bias in biases.items():
        if bias is not None:
            layers[name].bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return model.to(dt)
