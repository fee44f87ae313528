"""How a prompt row's arithmetic grows with its position, so a step's prompt piece can
shrink as the prompt gets longer and each step stays about as long as the first.

A prompt row costs its projections (the same at every position) plus its attention over
every earlier position of the global layers (growing with the position). With the
budget fixed in rows, a piece late in a 16K prompt of qwen2.5-0.5b costs about three
times one at its start, and the running streams beside it wait three times as long
between two tokens. ``RowCost.piece`` scales the budget down by the row's cost at the
piece's chunk instead: counted in arithmetic, the budget stays the same all along.
"""

from __future__ import annotations

from dataclasses import dataclass

from declattn.engine.models import ModelConfig
from declattn.engine.quant.linear import GEMM_ROWS

MIN_PIECE = GEMM_ROWS
"""A budget shrinks with the position only down to this many rows (and a budget of this
or fewer rows never shrinks): ``quant.linear.GEMM_ROWS``, below which a step's rows would
leave the dense GEMM for the integer kernel, several times slower per row."""
PIECE_MULTIPLE = 16
"""Scaled budgets are rounded down to a multiple of this, so pieces stay whole blocks."""


@dataclass(frozen=True)
class RowCost:
    """``even``: the position at which a row's attention costs as much arithmetic as its
    projections (``inf`` for a model without global layers)."""

    even: float

    @classmethod
    def of(cls, c: ModelConfig) -> RowCost:
        """From the model's shapes: per layer, the projections' multiply-adds (q, k, v, o
        and the three MLP matrices) against the attention's per earlier position (a
        query row against keys, then values) on the layers that see the whole prompt."""
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        projections = c.num_layers * (2 * c.hidden_size * q + 2 * c.hidden_size * kv
                                      + 3 * c.hidden_size * c.intermediate_size)
        global_layers = sum(c.window(i) is None for i in range(c.num_layers))
        per_position = global_layers * 2 * q
        return cls(projections / per_position if per_position else float("inf"))

    def piece(self, budget: int, position: int) -> int:
        """The most rows of a piece that starts its chunk at ``position``, for a budget of
        ``budget`` rows at position 0."""
        if budget <= MIN_PIECE:
            return budget
        scaled = int(budget / (1 + position / self.even))
        return max(MIN_PIECE, scaled - scaled % PIECE_MULTIPLE)
