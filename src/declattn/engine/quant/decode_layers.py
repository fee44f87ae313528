"""A short step's decoder layers as one flat run of kernel calls, for a GGUF model on CPU.

Why: a decode step of qwen2.5-0.5b is ~25 ms of kernels on two threads, and the module
tree around them cost ~5 ms more: per layer about 180 Python calls (module ``__call__``,
attribute lookups through ``nn.Module.__getattr__``, the fused ops' applicability checks,
the merged layers' lists of blocks built afresh), and even made flat, ~20 op calls of a
few microseconds each. Here everything a layer needs is looked up once, at load, and a
step makes three calls per layer: ``before_attention`` and ``after_attention``
(``quant/csrc/decode_layer.cpp``: the norms, the merged projections, RoPE, the residual
adds and the activation, op by op in native code) around the ``AttentionFn`` (which keeps
storing keys and values, choosing what is read, and counting it, exactly as before).

A pure decode step goes further: where the ``AttentionFn`` can say up front what each
layer stores and reads (``PlannedDecode.decode_reads``: no query-aware selection, native
kernels), every layer runs in one call of ``DecodeStack.run``, which calls the same
kernels the attention function would (store the new rows, decode attention over the
planned runs), and the reads are recorded once it returns, as the attention function
would have recorded them layer by layer.

The arithmetic is the modules' own, op for op in the same dtypes, so the result equals the
module path bit for bit (``tests/engine/test_quant_decode_layers.py``). It runs only where
every op it calls is what the module path would call: rows fewer than ``GEMM_ROWS`` (the
GGUF layers' decode kernel), CPU tensors in the model's dtype, no gradient wanted. For
anything else it returns ``None`` and the modules run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from declattn.engine.attention_api import AttentionFn, PlannedDecode
from declattn.engine.models.decoder import Decoder, DecoderLayer
from declattn.engine.models.fused import DTYPES
from declattn.engine.models.layers import RMSNorm
from declattn.engine.quant import linear
from declattn.engine.quant.kernel import decode_layer_ops
from declattn.engine.quant.linear import GGUFConcat, GGUFLinear

Rope = tuple[Tensor, Tensor]
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
"""What ``after_attention`` computes with ATen's own ops, as ``MLP`` does."""


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
    """What one ``DecoderLayer`` computes with, looked up once. Its norms are weights
    only: they share one ``eps`` and one form (``unit_offset``), as every family builds
    them."""

    eps: float
    unit_offset: bool
    attn_norm: Tensor
    qkv: Matmul
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    q_norm: Tensor | None
    k_norm: Tensor | None
    scale: float
    window: int | None
    o: Matmul
    post_attn_norm: Tensor | None
    mlp_norm: Tensor
    gate_up: Matmul
    activation: str
    down: Matmul
    post_mlp_norm: Tensor | None

    @classmethod
    def of(cls, layer: DecoderLayer) -> Layer | None:
        """``None`` unless every projection is a GGUF layer, merged where it can be, and
        the norms share one eps and form."""
        a, m = layer.attn, layer.mlp
        mats = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if not all(isinstance(x, GGUFLinear | GGUFConcat) for x in mats):
            return None
        if m.activation not in ACTIVATIONS:
            return None
        norms = (layer.attn_norm, layer.mlp_norm, layer.post_attn_norm, layer.post_mlp_norm)
        if a.q_norm is not None and a.k_norm is not None:
            norms += (a.q_norm, a.k_norm)
        forms = {(n.eps, n.unit_offset) for n in norms if n is not None}
        if len(forms) != 1:
            return None
        ((eps, unit_offset),) = forms
        qk = a.q_norm is not None and a.k_norm is not None
        return cls(
            eps, unit_offset, _weight(layer.attn_norm), Matmul.of(a.qkv_proj),
            (a.num_heads, a.num_kv_heads, a.head_dim), _weight(a.q_norm if qk else None),
            _weight(a.k_norm if qk else None), a.scale, a.window, Matmul.of(a.o_proj),
            _weight(layer.post_attn_norm), _weight(layer.mlp_norm), Matmul.of(m.gate_up_proj),
            m.activation, Matmul.of(m.down_proj), _weight(layer.post_mlp_norm),
        )

    def norms(self) -> list[Tensor]:
        return [n for n in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm,
                            self.post_attn_norm, self.post_mlp_norm) if n is not None]


def _weight(norm: RMSNorm | None) -> Any:
    return None if norm is None else norm.weight.detach()


class GGUFDecodeLayers:
    """A ``Decoder``'s layers for short steps (``Decoder.use_layer_runner``)."""

    def __init__(self, layers: list[Layer], dtype: torch.dtype) -> None:
        ops = decode_layer_ops()
        assert ops is not None, "built only where the layer ops load"
        self._layers = layers
        self._dtype = dtype
        self._before = ops.before_attention.default
        self._after = ops.after_attention.default
        self._windows = [x.window for x in layers]
        self._stack = torch.classes.declattn.DecodeStack()
        for x in layers:
            self._stack.add(
                x.attn_norm, x.eps, x.unit_offset, x.qkv.blocks, x.qkv.types, x.qkv.bias,
                *x.heads, x.q_norm, x.k_norm, x.scale, x.window is not None, x.o.blocks,
                x.o.types, x.o.bias, x.post_attn_norm, x.mlp_norm, x.gate_up.blocks,
                x.gate_up.types, x.gate_up.bias, x.activation, x.down.blocks, x.down.types,
                x.down.bias, x.post_mlp_norm,
            )

    @classmethod
    def of(cls, model: Decoder) -> GGUFDecodeLayers | None:
        """The runner for ``model``, or ``None`` where some layer is not all GGUF, its
        norms are not in the model's dtype, or a kernel cannot be had."""
        if decode_layer_ops() is None:
            return None
        layers = [Layer.of(layer) for layer in model.layers]
        if not layers or any(x is None for x in layers):
            return None
        dtype = model.norm.weight.dtype
        norms = [n for x in layers for n in x.norms()]  # type: ignore[union-attr]
        if dtype not in DTYPES or any(n.dtype != dtype for n in norms):
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
        reads = attn.decode_reads(self._windows) if isinstance(attn, PlannedDecode) else None
        if reads is not None and reads.n_rows == len(h) and reads.k_pools[0].dtype == h.dtype:
            h = self._stack.run(
                h, *rope_global, *rope_local, reads.k_pools, reads.v_pools, reads.row,
                reads.runs, reads.offsets, reads.min_split_rows,
            )
            reads.record()
            return h
        for i, layer in enumerate(self._layers):
            h = self._layer(i, layer, h, rope_global if layer.window is None else rope_local, attn)
        return h

    def _layer(self, i: int, x: Layer, h: Tensor, rope: Rope, attn: AttentionFn) -> Tensor:
        qkv, o, gu, down = x.qkv, x.o, x.gate_up, x.down
        q, k, v = self._before(
            h, x.attn_norm, x.eps, x.unit_offset, qkv.blocks, qkv.types, qkv.bias, *x.heads,
            x.q_norm, x.k_norm, *rope,
        )
        out = attn(i, q, k, v, scale=x.scale, window=x.window)
        return self._after(
            h, out, x.eps, x.unit_offset, o.blocks, o.types, o.bias, x.post_attn_norm,
            x.mlp_norm, gu.blocks, gu.types, gu.bias, x.activation, down.blocks, down.types,
            down.bias, x.post_mlp_norm,
        )
