"""RMSNorm and RoPE as one native call each on CPU tensors (``engine/csrc/norm_rope.cpp``).

Why: each is 6-8 small torch ops (casts, pow, mean, rsqrt, slices, cat) whose fixed cost
per op, not their arithmetic, is what a decode step pays: ~97 such calls per step of a
24-layer model. The kernel does the same arithmetic in the same roundings (fp32 inside,
the activation dtype where the torch code rounds); it is part of the native extension
(``engine/native``). Anything it does not take (a GPU tensor, fp16, a weight in another
dtype than the activations, a gradient wanted: it has no backward) returns ``None`` and
the caller runs its torch code; so does a machine without the extension (one warning,
from ``native.library``) or ``DECLATTN_LAYER_KERNEL=torch`` (chosen: no warning).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from declattn.engine import native

ENV_SWITCH = "DECLATTN_LAYER_KERNEL"
DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def layer_ops() -> Any:
    """``torch.ops.declattn`` for ``rms_norm``, ``rotary`` and greedy's ``argmax``
    (``sampler.greedy``); ``None`` where switched off or unavailable."""
    return native.ops(ENV_SWITCH)


def _takes(*tensors: Tensor) -> Any:
    """The ops, if they apply: CPU, bf16/fp32, and no gradient wanted (the kernel has no
    backward; training runs the torch code)."""
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return layer_ops()


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor | None:
    """``RMSNorm.forward`` in one call, or ``None`` where the kernel does not apply."""
    ops = _takes(x, weight)
    if ops is None or weight.dtype != x.dtype or weight.device != x.device:
        return None
    return ops.rms_norm(x.contiguous(), weight.contiguous(), eps, unit_offset)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """``apply_rotary`` in one call, or ``None`` where the kernel does not apply."""
    ops = _takes(x, cos, sin)
    if ops is None or x.dim() != 3 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return None
    return ops.rotary(x.contiguous(), cos.contiguous(), sin.contiguous())
