"""The CPU flash-attention op that returns its log-sum-exp, shared by decode and prefill."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor


@functools.cache
def flash_with_lse() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The CPU flash-attention op that also returns the log-sum-exp, if torch has it.

    Public SDPA does not return the log-sum-exp that merging partial attentions needs;
    this op (what SDPA itself calls on CPU) does. Without it, decode reads every run
    through BLAS and prefill uses an explicit mask: slower, same results."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None
