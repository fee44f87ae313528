"""The prefill budget in arithmetic: a piece further into a prompt carries fewer rows, at
places that depend on the position only (so a cached prefix stays bit for bit)."""

from __future__ import annotations

import pytest
from test_engine import tiny_model
from test_scheduler import engine

from declattn.engine.row_cost import MIN_PIECE, PIECE_MULTIPLE, RowCost


def test_even_is_the_position_where_attention_costs_the_projections() -> None:
    c = tiny_model().config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h = c.hidden_size
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size
    assert RowCost.of(c).even == pytest.approx(per_layer / (2 * q))  # every layer global


@pytest.mark.parametrize("budget", [256, 512, 100])
def test_the_budget_shrinks_with_the_position_down_to_the_floor(budget: int) -> None:
    cost = RowCost(even=4096.0)
    pieces = [cost.piece(budget, p) for p in range(0, 64 * 1024, 512)]
    assert pieces[0] == budget - budget % PIECE_MULTIPLE
    assert all(a >= b for a, b in zip(pieces, pieces[1:], strict=False))
    assert min(pieces) == MIN_PIECE and all(p % PIECE_MULTIPLE == 0 for p in pieces)
    assert cost.piece(budget, 4096) == pytest.approx(budget / 2, abs=PIECE_MULTIPLE)


def test_a_small_budget_never_shrinks() -> None:
    assert {RowCost(even=10.0).piece(MIN_PIECE, p) for p in (0, 10**6)} == {MIN_PIECE}


def test_the_engine_cuts_pieces_by_the_models_row_cost() -> None:
    model = tiny_model(seed=35)
    eng = engine(model, prefill_chunk=256, prefill_budget=128)
    cost = RowCost.of(model.config)
    cuts, start = [], 0
    while start < 1024:
        stop = eng.scheduler.piece_stop(start, 1024)
        base = start - start % 256
        assert stop - start <= cost.piece(128, base)
        assert (stop - base) % cost.piece(128, base) == 0 or stop % 256 == 0
        cuts.append(stop)
        start = stop
    assert len(cuts) > 1024 // 128  # later pieces are smaller than the first
