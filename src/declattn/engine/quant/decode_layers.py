"""A GGUF model's decode step as one native call for all its layers, on CPU: the ``stack``
decode route (``engine/route.py`` chooses it at load).

Why: a decode step of qwen2.5-0.5b is ~25 ms of kernels on two threads, and the module
tree around them cost ~5 ms more: per layer about 180 Python calls (module ``__call__``,
attribute lookups through ``nn.Module.__getattr__``, the fused ops' applicability checks,
the merged layers' lists of blocks built afresh), and even made flat, ~20 op calls of a
few microseconds each. Here everything a layer needs is looked up once, at load, into a
``DecodeStack`` (``csrc/decode_layer.cpp``), and a step is one call of its ``run``: per
layer the norms, the merged projections, RoPE, storing the new keys and values, decode
attention over the runs the step planned, the residual adds and the activation, op by op
in native code. The ``AttentionFn`` says up front what each layer stores and reads
(``PlannedDecode.decode_reads``) and records the reads once the call returns, as it would
have layer by layer.

A decode step whose reads cannot be planned up front (a query-aware controller picks each
layer's blocks from its query) runs layer by layer instead: ``before_attention`` and
``after_attention``, the same code in two native calls per layer, around the
``AttentionFn``. That is still measurably faster than the modules (docs/engine.md), and is
counted with its reason. A step neither way can compute as the modules do (32 rows or
more, another dtype, a gradient wanted) runs the modules, counted too.

The arithmetic is the modules' own, op for op in the same dtypes, so the result equals the
module path bit for bit (``tests/engine/test_quant_decode_layers.py``).
"""

from __future__ import annotations

from collections import Counter
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
    def of(cls, i: int, layer: DecoderLayer) -> Layer | str:
        """The layer, or why the stack cannot run it: a projection that is not a GGUF layer
        (merged where it can be), an activation ``after_attention`` does not compute, or
        norms that do not share one eps and form."""
        a, m = layer.attn, layer.mlp
        mats = {"q/k/v": a.qkv_proj, "o_proj": a.o_proj, "gate/up": m.gate_up_proj,
                "down_proj": m.down_proj}
        for name, x in mats.items():
            if not isinstance(x, GGUFLinear | GGUFConcat):
                return f"layer {i}'s {name} is {type(x).__name__}, not GGUF blocks"
        if m.activation not in ACTIVATIONS:
            return f"layer {i}'s activation {m.activation} is not one of {ACTIVATIONS}"
        norms = (layer.attn_norm, layer.mlp_norm, layer.post_attn_norm, layer.post_mlp_norm)
        if a.q_norm is not None and a.k_norm is not None:
            norms += (a.q_norm, a.k_norm)
        forms = {(n.eps, n.unit_offset) for n in norms if n is not None}
        if len(forms) != 1:
            return f"layer {i}'s norms differ in eps or form"
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
    """A ``Decoder``'s decode steps, one native call each (its ``stack`` route)."""

    def __init__(self, layers: list[Layer], dtype: torch.dtype) -> None:
        ops = decode_layer_ops()
        assert ops is not None, "made only where the layer ops load (engine/route.py)"
        self._layers = layers
        self._dtype = dtype
        self._before = ops.before_attention.default
        self._after = ops.after_attention.default
        self._windows = [x.window for x in layers]
        self.missed: Counter[str] = Counter()
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
    def layers_of(cls, model: Decoder) -> list[Layer] | str:
        """What each of ``model``'s layers computes with, or why its layers do not qualify:
        dense weights, a layer not all GGUF, activations or norms in another dtype. (Its
        kernels are ``engine/route.py``'s to check.)"""
        if not any(isinstance(m, GGUFLinear | GGUFConcat) for m in model.modules()):
            return "dense weights (the stack takes GGUF blocks)"
        dtype = model.norm.weight.dtype
        if dtype not in DTYPES:
            return f"activations in {dtype} (the native layer ops take bf16 or fp32)"
        layers = []
        for i, module in enumerate(model.layers):
            layer = Layer.of(i, module)
            if isinstance(layer, str):
                return layer
            if any(n.dtype != dtype for n in layer.norms()):
                return f"layer {i}'s norm weights are not in the model's {dtype}"
            layers.append(layer)
        return layers or "the model has no layers"

    def __call__(
        self, h: Tensor, rope_global: Rope, rope_local: Rope, attn: AttentionFn
    ) -> Tensor | None:
        """``h`` ``[T, hidden]`` through every layer; ``None`` where the modules run the
        step (one not a decode step on paged KV, or one counted in ``missed``)."""
        reads = attn.decode_reads(self._windows) if isinstance(attn, PlannedDecode) else None
        if reads is None:
            return None
        unlike = self._unlike_the_modules(h, rope_global, rope_local)
        if unlike is not None:
            self.missed[f"{unlike}: the modules ran it"] += 1
            return None
        if isinstance(reads, str):
            self.missed[f"{reads}: layer by layer"] += 1
            return self._by_layer(h, rope_global, rope_local, attn)
        if reads.n_rows != len(h):
            raise ValueError(f"the step has {reads.n_rows} rows, h {len(h)}")
        pool = reads.k_pools[0].dtype
        if pool != h.dtype:
            self.missed[f"KV pool in {pool}, activations in {h.dtype}: layer by layer"] += 1
            return self._by_layer(h, rope_global, rope_local, attn)
        h = self._stack.run(
            h, *rope_global, *rope_local, reads.k_pools, reads.v_pools, reads.rows,
            reads.runs, reads.offsets, reads.min_split_rows,
        )
        reads.record()
        return h

    def _unlike_the_modules(self, h: Tensor, rope_global: Rope, rope_local: Rope) -> str | None:
        """Why the native ops would not compute this step as the modules do, if they would
        not."""
        # read at each call, as GGUFLinear does (bench/quant_accuracy moves it)
        if len(h) >= linear.GEMM_ROWS:
            return f"{len(h)} rows (from {linear.GEMM_ROWS}, GGUF layers take the GEMM way)"
        if h.dtype != self._dtype:
            return f"activations in {h.dtype}, the model in {self._dtype}"
        if torch.is_grad_enabled():
            return "gradients enabled (the native ops have no backward)"
        if rope_global[0].dtype != torch.float32 or rope_local[0].dtype != torch.float32:
            return "RoPE tables not in fp32"
        return None

    def _by_layer(self, h: Tensor, rope_global: Rope, rope_local: Rope,
                  attn: AttentionFn) -> Tensor:
        for i, x in enumerate(self._layers):
            cos, sin = rope_global if x.window is None else rope_local
            qkv, o, gu, down = x.qkv, x.o, x.gate_up, x.down
            q, k, v = self._before(
                h, x.attn_norm, x.eps, x.unit_offset, qkv.blocks, qkv.types, qkv.bias,
                *x.heads, x.q_norm, x.k_norm, cos, sin,
            )
            out = attn(i, q, k, v, scale=x.scale, window=x.window)
            h = self._after(
                h, out, x.eps, x.unit_offset, o.blocks, o.types, o.bias, x.post_attn_norm,
                x.mlp_norm, gu.blocks, gu.types, gu.bias, x.activation, down.blocks,
                down.types, down.bias, x.post_mlp_norm,
            )
        return h
