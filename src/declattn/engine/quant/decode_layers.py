"""A short step's decoder layers as one flat run of kernel calls, for a GGUF model on CPU.

Why: a decode step of qwen2.5-0.5b is ~25 ms of kernels on two threads, and the module
tree around them cost ~5 ms more: per layer about 180 Python calls (module ``__call__``,
attribute lookups through ``nn.Module.__getattr__``, the fused ops' applicability checks,
the merged layers' lists of blocks built afresh). Here everything a layer needs is looked
up once, at load, and a step makes only the calls that compute: per layer two norms, two
merged projections and two single ones, two rotations, the residual adds, and the
``AttentionFn`` (which keeps storing keys and values, choosing what is read, and counting
it, exactly as before).

The arithmetic is the modules' own, op for op in the same dtypes, so the result equals the
module path bit for bit (``tests/engine/test_quant_decode_layers.py``). It runs only where
every op it calls is what the module path would call: rows fewer than ``GEMM_ROWS`` (the
GGUF layers' decode kernel), CPU tensors in the model's dtype, no gradient wanted. For
anything else it returns ``None`` and the modules run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.attention_api import AttentionFn
from declattn.engine.models.decoder import Decoder, DecoderLayer
from declattn.engine.models.fused import DTYPES, layer_ops
from declattn.engine.models.layers import RMSNorm
from declattn.engine.quant import linear
from declattn.engine.quant.kernel import gguf_ops
from declattn.engine.quant.linear import GGUFConcat, GGUFLinear

Rope = tuple[Tensor, Tensor]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class Norm:
    weight: Tensor
    eps: float
    unit_offset: bool

    @classmethod
    def of(cls, norm: RMSNorm | None) -> Norm | None:
        return None if norm is None else cls(norm.weight.detach(), norm.eps, norm.unit_offset)


@dataclass(frozen=True)
class Matmul:
    """One kernel call: the blocks of one or several matrices, their layouts, the bias."""

    blocks: list[Tensor]
    types: list[int]
    bias: Tensor | None

    @classmethod
    def of(cls, layer: GGUFLinear | GGUFConcat) -> Matmul:
        if isinstance(layer, GGUFConcat):
            return cls([p.blocks for p in layer.parts], list(layer.types), layer.joined_bias)
        bias = None if layer.bias is None else layer.bias.detach()
        return cls([layer.blocks], [layer.kernel_type], bias)


@dataclass(frozen=True)
class Layer:
    """What one ``DecoderLayer`` computes with, looked up once."""

    attn_norm: Norm
    qkv: Matmul
    split: tuple[int, int, int]
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    q_norm: Norm | None
    k_norm: Norm | None
    scale: float
    window: int | None
    o: Matmul
    post_attn_norm: Norm | None
    mlp_norm: Norm
    gate_up: Matmul
    activation: Callable[[Tensor], Tensor]
    down: Matmul
    post_mlp_norm: Norm | None

    @classmethod
    def of(cls, layer: DecoderLayer) -> Layer | None:
        """``None`` unless every projection is a GGUF layer, merged where it can be."""
        a, m = layer.attn, layer.mlp
        mats = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if not all(isinstance(x, GGUFLinear | GGUFConcat) for x in mats):
            return None
        if m.activation not in ACTIVATIONS:
            return None
        kv = a.num_kv_heads * a.head_dim
        return cls(
            Norm.of(layer.attn_norm), Matmul.of(a.qkv_proj), (a.num_heads * a.head_dim, kv, kv),
            (a.num_heads, a.num_kv_heads, a.head_dim), Norm.of(a.q_norm), Norm.of(a.k_norm),
            a.scale, a.window, Matmul.of(a.o_proj), Norm.of(layer.post_attn_norm),
            Norm.of(layer.mlp_norm), Matmul.of(m.gate_up_proj), ACTIVATIONS[m.activation],
            Matmul.of(m.down_proj), Norm.of(layer.post_mlp_norm),
        )


class GGUFDecodeLayers:
    """A ``Decoder``'s layers for short steps (``Decoder.use_layer_runner``)."""

    def __init__(self, layers: list[Layer], dtype: torch.dtype) -> None:
        gguf, norm_rope = gguf_ops(), layer_ops()
        assert gguf is not None and norm_rope is not None, "built only where both kernels load"
        self._layers = layers
        self._dtype = dtype
        self._cat = gguf.gguf_linear_cat.default
        self._norm = norm_rope.rms_norm.default
        self._rotary = norm_rope.rotary.default

    @classmethod
    def of(cls, model: Decoder) -> GGUFDecodeLayers | None:
        """The runner for ``model``, or ``None`` where some layer is not all GGUF, its
        norms are not in the model's dtype, or a kernel cannot be had."""
        if gguf_ops() is None or layer_ops() is None:
            return None
        layers = [Layer.of(layer) for layer in model.layers]
        if not layers or any(x is None for x in layers):
            return None
        dtype = model.norm.weight.dtype
        norms = [n for x in layers for n in (x.attn_norm, x.mlp_norm, x.q_norm, x.k_norm,
                                              x.post_attn_norm, x.post_mlp_norm) if n]
        if dtype not in DTYPES or any(n.weight.dtype != dtype for n in norms):
            return None
        return cls(layers, dtype)  # type: ignore[arg-type]

    def __call__(
        self, h: Tensor, rope_global: Rope, rope_local: Rope, attn: AttentionFn
    ) -> Tensor | None:
        """``h`` ``[T, hidden]`` through every layer, or ``None`` where the modules must
        run instead (see the module docstring)."""
        # read at each call, as GGUFLinear does (bench/quant_accuracy moves it)
        if h.dim() != 2 or h.shape[0] >= linear.GEMM_ROWS or h.device.type != "cpu":
            return None
        if h.dtype != self._dtype or torch.is_grad_enabled():
            return None
        if rope_global[0].dtype != torch.float32 or rope_local[0].dtype != torch.float32:
            return None
        for i, layer in enumerate(self._layers):
            h = self._layer(i, layer, h, rope_global if layer.window is None else rope_local, attn)
        return h

    def _layer(self, i: int, x: Layer, h: Tensor, rope: Rope, attn: AttentionFn) -> Tensor:
        t = h.shape[0]
        heads, kv_heads, dim = x.heads
        q, k, v = self._matmul(x.qkv, self._rms(x.attn_norm, h)).split(x.split, dim=-1)
        q, k = q.view(t, heads, dim), k.view(t, kv_heads, dim)
        if x.q_norm is not None and x.k_norm is not None:
            q, k = self._rms(x.q_norm, q), self._rms(x.k_norm, k)
        cos, sin = rope
        q = self._rotary(q.contiguous(), cos, sin)
        k = self._rotary(k.contiguous(), cos, sin)
        out = attn(i, q, k, v.view(t, kv_heads, dim), scale=x.scale, window=x.window)
        a = self._matmul(x.o, out.reshape(t, heads * dim))
        if x.post_attn_norm is not None:
            a = self._rms(x.post_attn_norm, a)
        h = h + a
        gate, up = self._matmul(x.gate_up, self._rms(x.mlp_norm, h)).chunk(2, dim=-1)
        m = self._matmul(x.down, x.activation(gate) * up)
        if x.post_mlp_norm is not None:
            m = self._rms(x.post_mlp_norm, m)
        return h + m

    def _rms(self, n: Norm, x: Tensor) -> Tensor:
        return self._norm(x.contiguous(), n.weight, n.eps, n.unit_offset)

    def _matmul(self, mm: Matmul, x: Tensor) -> Tensor:
        y = self._cat(x.contiguous(), mm.blocks, mm.types)
        return y if mm.bias is None else y + mm.bias
