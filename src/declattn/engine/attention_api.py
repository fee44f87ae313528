"""The one seam between model code and KV storage.

Model code computes q, k, v for the new tokens of a step (after norms and RoPE) and
calls an ``AttentionFn``; the function owns where keys and values are stored and which
of them are read. The model never sees blocks, views or sequences, so the same model
code runs dense (tests, parity), paged-full (prefill) and paged-with-view (DA decode).

A layer runner that does a whole decode step in one native call (``quant/decode_layers``)
cannot call back per layer; ``PlannedDecode`` lets it ask the ``AttentionFn`` up front
what each layer stores and reads (``DecodeReads``), and the function still counts the
reads. Where the function cannot say why not (or is not paged), the modules run the step
and call it per layer (``engine/route.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class DecodeReads:
    """What a pure decode step's attention reads on each layer, for a layer runner that
    runs the whole step in one native call (``quant/decode_layers.py``) instead of calling
    the ``AttentionFn`` per layer: where each layer stores its new keys and values, and
    the runs its decode kernel reads. ``record`` must be called once that call returns:
    it counts the reads, as the per-layer calls would have."""

    n_rows: int
    """The step's rows (its decode rows): the ``T`` of ``h [T, hidden]``."""
    k_pools: list[Tensor]
    v_pools: list[Tensor]
    rows: Tensor
    """The pool row of each of the step's new tokens (int64 ``[T]``)."""
    runs: list[Tensor]
    offsets: list[Tensor]
    """Per layer, the decode kernel's ``runs`` and ``offsets`` (``decode.RunBatch``)."""
    min_split_rows: int
    record: Callable[[], None]


class PlannedDecode(ABC):
    """An ``AttentionFn`` that can hand a pure decode step's reads to a native layer
    runner. A base class rather than a runtime-checked ``Protocol``: the runner asks
    ``isinstance`` once a step, and a runtime protocol check walks the protocol's
    attributes on every call."""

    @abstractmethod
    def decode_reads(self, windows: Sequence[int | None]) -> DecodeReads | str | None:
        """The reads of this pure decode step's layers (``windows[i]``: layer i's sliding
        window, ``None`` for a global layer; one per layer). ``None`` where the step is not
        a pure decode step (a prefill row in it: the modules' work); for a decode step whose
        reads cannot be planned up front, a sentence saying why (query-aware selection: a
        layer's blocks depend on its query; the torch decode kernel)."""
