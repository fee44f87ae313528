"""A GGUF's matrices as quantized linear layers, read from its own blocks.

Which kernel a tensor goes to depends on its GGUF format and on ``QuantPolicy``: the
GGUF kernel (``kernel.py``) multiplies by the file's blocks as they are; torch's int4 and
int8 kernels take the codes, re-rounded where they do not fit (``requant``). Norms,
biases and the embedding table are not handled here: they come from the converted Hugging
Face directory like every other dense tensor (the embedding is looked up one row per
token, so its bytes per step are negligible and it stays exact). A tied output
projection gets a quantized copy of the embedding table for the logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from declattn.engine.gguf_convert import GGUFModel, hf_name, unpermute_rope
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.hf_names import internal_name
from declattn.engine.quant.blocks import DECODABLE, group_codes
from declattn.engine.quant.kernel import NATIVE_TYPES
from declattn.engine.quant.linear import GGUFLinear, QuantLinear, int4_fits, int8_fits
from declattn.engine.quant.requant import INT4_GROUP, int4_exact, int4_rounded, int8_rounded

Q = GGMLQuantizationType

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})
TIED_HEAD = "tied_head"
"""The ``Decoder`` module that holds a quantized copy of a tied embedding for the logits."""


@dataclass(frozen=True)
class QuantPolicy:
    """Which kernel each GGUF format goes to.

    ``native``: a format the GGUF kernel takes (``kernel.NATIVE_TYPES``) is multiplied by
    as the file stores it: the same bytes and the same numbers as llama.cpp. Without it
    (or without a compiler) torch's kernels take over: 4-bit formats go to the int4
    kernel code for code; ``wide`` formats (Q5_*, Q6_K, Q8_0, any other quantized type)
    are rounded again, to ``"int8"`` per row or ``"int4"`` per 32-group; ``head`` makes
    the same choice for the output projection. Float tensors stay dense.
    """

    native: bool = True
    wide: str = "int8"
    head: str = "int8"

    def __post_init__(self) -> None:
        for name in ("wide", "head"):
            if getattr(self, name) not in ("int4", "int8"):
                raise ValueError(f"QuantPolicy.{name} must be 'int4' or 'int8'")

    def tag(self) -> str:
        return f"{'native' if self.native else 'torch'}.wide-{self.wide}.head-{self.head}"


@dataclass(frozen=True)
class Planned:
    """One matrix of the file and what it becomes."""

    gguf_name: str
    module: str
    kind: Q
    target: str  # "gguf" | "int4-exact" | "int4" | "int8" | "dense"


def _module_of(config: ModelConfig, gguf_name: str, architecture: str) -> str | None:
    """The ``Decoder`` module a GGUF matrix feeds, or ``None`` for a non-linear tensor."""
    if gguf_name == "token_embd.weight":
        return TIED_HEAD if config.tie_word_embeddings else None
    name = internal_name(config, hf_name(gguf_name, architecture))
    if name is None or not (name.endswith("_proj.weight") or name == "lm_head.weight"):
        return None
    return name.removesuffix(".weight")


def plan(gg: GGUFModel, config: ModelConfig, policy: QuantPolicy) -> list[Planned]:
    """Every matrix of ``gg`` that a linear layer multiplies by, with its target."""
    out = []
    for t in gg.reader.tensors:
        module = _module_of(config, t.name, gg.architecture)
        if module is None:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        kind = Q(t.tensor_type)
        head = module in ("lm_head", TIED_HEAD)
        if kind in FLOAT_TYPES:
            target = "dense"
        elif policy.native and int(kind) in NATIVE_TYPES:
            target = "gguf"
        elif kind in (Q.Q4_0, Q.Q4_1, Q.Q4_K) and not head and int4_fits(rows, cols):
            target = "int4-exact"
        else:
            target = policy.head if head else policy.wide
            if target == "int4" and not int4_fits(rows, cols, INT4_GROUP):
                target = "int8"
            if target == "int8" and not int8_fits(rows, cols):
                target = "dense"
        out.append(Planned(t.name, module, kind, target))
    return out


def _row_order(config: ModelConfig, module: str, rows: int, architecture: str) -> np.ndarray | None:
    """llama.cpp permutes llama's q/k rows (see ``gguf_convert``); the inverse order."""
    if architecture != "llama" or not module.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
    return unpermute_rope(np.arange(rows)[:, None], heads)[:, 0]


def quantized_layers(
    gg: GGUFModel, config: ModelConfig, dtype: torch.dtype, policy: QuantPolicy
) -> Iterator[tuple[Planned, QuantLinear]]:
    """Build each planned non-dense layer, without its bias (a dense tensor, loaded with
    the others)."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in gg.reader.tensors}
    for p in plan(gg, config, policy):
        if p.target == "dense":
            continue
        t = tensors[p.gguf_name]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        order = _row_order(config, p.module, rows, gg.architecture)
        if p.target == "gguf":
            blocks = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(rows, -1))
            if order is not None:
                blocks = np.ascontiguousarray(blocks[order])  # a row is whole blocks
            # the file's layout: these layers are stored (the loaded ones regroup)
            blocks_t = torch.from_numpy(blocks.copy())
            yield p, GGUFLinear(blocks_t, int(p.kind), cols, group_rows=-1)
            continue
        if p.kind in DECODABLE:
            codes = group_codes(t.data, p.kind, (rows, cols))
            if order is not None:
                codes = codes.take_rows(order)
            if p.target == "int4-exact":
                yield p, int4_exact(codes, dtype)
                continue
            w = codes.dequantize()
        else:
            w = np.asarray(dequantize(t.data, p.kind), dtype=np.float32).reshape(rows, cols)
            if order is not None:
                w = w[order]
        if p.target == "int4":
            yield p, int4_rounded(w, dtype)
        else:
            yield p, int8_rounded(w, dtype)
