"""Run planning: kept blocks become slices of consecutive pool rows plus one gather,
and the plan names exactly the logical blocks its reads cover."""

from __future__ import annotations

import numpy as np

from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.runs import PlanMemo, RunPlan, checked_view, plan_runs, sorted_unique


def test_short_whole_block_runs_are_gathered_and_the_rest_sliced() -> None:
    short = [(0, 16), (32, 48), (64, 128), (160, 176), (192, 208), (224, 240), (256, 272),
             (288, 320)]
    split = [(1500, 2090), *short, (329, 400), (401, 402), (900, 1499)]
    plan = RunPlan.from_rows(split, 16)
    assert plan.rows.tolist() == [list(r) for r in split]  # the kernel reads them as given
    assert plan.pieces.gather is not None
    assert plan.pieces.gather.tolist() == [0, 2, 4, 5, 6, 7, 10, 12, 14, 16, 18, 19]
    assert sorted(plan.pieces.slices) == [(329, 400), (401, 402), (900, 1499), (1500, 2090)]
    assert plan.n_rows == sum(b - a for a, b in split)
    assert RunPlan.from_rows(split[:4], 16).pieces.gather is None  # a few runs stay slices


def test_runs_follow_logical_order_and_name_the_logical_blocks() -> None:
    """Logical blocks 0..5 live at physical 7, 8, 2, 3, 4, 10; keeping 0, 1, 3, 4, 5 of a
    length-22 sequence (block size 4) reads physical 7-8 as one run, then 3-4 (logical
    order, though they sit lower in the pool), and only the 2 filled rows of the newest
    block (physical 10)."""
    table = [7, 8, 2, 3, 4, 10]
    plan = plan_runs(table, [0, 1, 3, 4, 5], 0, 22, 4, "cpu")
    assert plan.pieces.gather is None
    assert plan.rows.tolist() == [[28, 36], [12, 20], [40, 42]]
    assert plan_runs(table, [5, 3, 0, 4, 1, 3], 0, 22, 4, "cpu").rows.tolist() == (
        plan.rows.tolist())  # a view is a set: its order and repeats change nothing
    assert plan.blocks == (0, 1, 3, 4, 5)
    assert plan.n_rows == 8 + 8 + 2


def test_window_bounds_cut_partial_blocks_and_inverse_matches_table() -> None:
    """Positions [6, 22) only: block 1 is read from its third row; the inverse table gives
    the same plan as the table."""
    table = np.array([7, 8, 2, 3, 4, 10])
    inverse = np.full(11, -1)
    inverse[table] = np.arange(table.size)
    a = plan_runs(table, range(1, 6), 6, 22, 4, "cpu")
    b = plan_runs(table, range(1, 6), 6, 22, 4, "cpu", inverse)
    assert (a.rows.tolist(), a.blocks, a.n_rows) == (b.rows.tolist(), b.blocks, b.n_rows)
    assert a.rows.tolist() == [[34, 36], [8, 20], [40, 42]]
    assert a.blocks == (1, 2, 3, 4, 5) and a.n_rows == 16


def test_sorted_unique_takes_a_sorted_view_as_it_is_and_mends_any_other() -> None:
    assert sorted_unique([1, 4, 9]).tolist() == [1, 4, 9]
    assert sorted_unique((9, 1, 4, 4, 1)).tolist() == [1, 4, 9]
    assert sorted_unique([3, 3]).tolist() == [3]  # a repeat is not increasing
    assert sorted_unique(()).dtype == np.int64 and sorted_unique(()).size == 0


def _planned(plan: RunPlan) -> tuple:
    return plan.rows.tolist(), plan.blocks, plan.n_rows


def test_the_memo_plans_every_step_as_planning_afresh_does() -> None:
    """Sequences decode one position a step for 300 steps while their tables grow (a new
    array at each new block, interleaved so runs split) and their views change: kept
    as the same tuple, an equal new one, another one, or none. Each step's plan through
    the memo equals ``plan_runs`` of that step; most steps extend the last one."""
    rng = np.random.default_rng(7)
    bs = 4
    cache = KVCache(KVConfig(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=512,
                             block_size=bs))
    lengths = {s: int(rng.integers(1, 40)) for s in range(3)}
    views: dict[int, tuple[int, ...] | None] = dict.fromkeys(lengths)
    memo, extended, extended_by_equal = PlanMemo(), 0, 0
    for _ in range(300):
        memo.next_step()
        for s in lengths:
            lengths[s] += 1
            length = lengths[s]
            cache.allocate(s, length)
            n_blocks = -(-length // bs)
            old, renewed = views[s], False
            if old is not None and old[-1] != n_blocks - 1 or rng.random() < 0.1:
                kept = rng.random(n_blocks) < 0.5
                kept[-1] = True
                views[s] = None if rng.random() < 0.2 else tuple(np.flatnonzero(kept).tolist())
            elif old is not None and rng.random() < 0.3:
                views[s], renewed = tuple(list(old)), True  # equal, not the same object
            view, whole = views[s], cache.block_array(s)
            keep = range(n_blocks) if view is None else checked_view(s, view, n_blocks)
            fresh = plan_runs(whole[:n_blocks], keep, 0, length, bs, "cpu")
            got = memo.plan(s, whole, view, length, lambda f=fresh: f)
            extended += got is not fresh
            extended_by_equal += renewed and got is not fresh
            assert _planned(got) == _planned(fresh)
    assert extended > 300  # most steps of three sequences extend their last plan
    assert extended_by_equal > 0  # an equal view, not the same object, extends too


def test_the_memo_plans_afresh_after_a_skipped_step_or_a_new_table() -> None:
    """A sequence left out of a step leaves the memo; a table changed in place of the
    array the memo saw (another object) is planned afresh."""
    table = np.array([3, 4, 9])
    memo, calls = PlanMemo(), []

    def fresh(length: int) -> RunPlan:
        calls.append(length)
        return plan_runs(table, [0, 2], 0, length, 4, "cpu")

    memo.next_step()
    memo.plan(0, table, (0, 2), 9, lambda: fresh(9))
    memo.next_step()
    assert _planned(memo.plan(0, table, (0, 2), 10, lambda: fresh(10))) == _planned(fresh(10))
    assert calls == [9, 10]  # extended, then fresh() called by the assertion only
    memo.next_step()
    memo.next_step()  # a step without the sequence
    memo.plan(0, table, (0, 2), 11, lambda: fresh(11))
    assert calls[-1] == 11
    memo.next_step()
    memo.plan(0, table.copy(), (0, 2), 12, lambda: fresh(12))
    assert calls[-1] == 12
