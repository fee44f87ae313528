"""The one seam between model code and KV storage.

Model code computes q, k, v for the new tokens of a step (after norms and RoPE) and
calls an ``AttentionFn``; the function owns where keys and values are stored and which
of them are read. The model never sees blocks, views or sequences, so the same model
code runs dense (tests, parity), paged-full (prefill) and paged-with-view (DA decode).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class AttentionFn(Protocol):
    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> Tensor:
        """Attend the step's new tokens.

        ``q``: ``[T, n_heads, head_dim]``; ``k``, ``v``: ``[T, n_kv_heads, head_dim]`` for
        the T new tokens of the step (all sequences of the batch, concatenated in batch
        order). ``scale`` multiplies q·k. ``window``: a sliding-window layer sees only the
        last ``window`` positions (itself included); ``None`` marks a global layer, the
        only kind a DA view restricts. Returns ``[T, n_heads, head_dim]``.
        """
        ...
