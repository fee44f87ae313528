"""One sequence's share of a batch step: the rows it adds and what they may read.

The engine builds one per sequence per step (``forward.py``); ``PagedAttention`` plans
its reads from it (``paged.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a batch step.

    Its ``n_new`` tokens sit at positions ``start .. start + n_new - 1`` and are rows of
    the step's q/k/v in batch order. ``view`` lists the logical blocks
    (``position // block_size``) that global layers may read on a decode row
    (``n_new == 1``); ``None`` reads everything. Prefill rows ignore the view: every
    mode attends fully during prefill.

    ``select``, when given, replaces ``view`` on each global layer of a decode row: it is
    called with the layer index and the row's query ``[H, D]`` (rotated, unscaled) once
    that layer's new key is stored, and returns the blocks that layer reads. It is the
    hook for query-aware selection (Quest-style baselines), which cannot know its blocks
    before the query exists.
    """

    seq_id: int
    start: int
    n_new: int
    view: Sequence[int] | None = None
    select: Callable[[int, Tensor], Sequence[int] | None] | None = None
    row_views: Sequence[Sequence[int] | None] | None = None
    """Prefill rows that recompute decode steps: each row's view on global layers
    (``None`` for a row that read everything), so the K/V recomputed is what those
    steps computed. Absent for an ordinary prefill. With ``decode_rows``: each decode
    row's view."""
    prefill: bool = False
    """The rows are a piece of a prompt (or of a recompute), attended causally over every
    stored position whatever their number: one row of a prompt is no decode row."""
    decode_rows: bool = False
    """The ``n_new`` rows are decode rows (a newest token and the forced tokens after it,
    ``Controller.forced``): each reads its ``row_views`` entry up to its own position,
    as a decode row of its own (``paged.py``)."""

    @property
    def length(self) -> int:
        """Sequence length once this step's tokens are stored."""
        return self.start + self.n_new

    @property
    def is_decode(self) -> bool:
        """Its rows are decode rows: one new token not of a prefill piece, or
        ``decode_rows``."""
        return not self.prefill and (self.n_new == 1 or self.decode_rows)
