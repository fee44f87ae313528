"""Run planning: kept blocks become slices of consecutive pool rows plus one gather,
and the plan names exactly the logical blocks its reads cover."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.engine.runs import Carried, PlanCarry, RunPlan, plan_runs, sorted_unique, view_key


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


def _same(a: RunPlan, b: RunPlan) -> bool:
    return (a.rows.tolist(), a.blocks, a.n_rows) == (b.rows.tolist(), b.blocks, b.n_rows)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_carried_plan_is_the_plan_of_its_step(data: st.DataObject) -> None:
    """Step after step over a growing sequence (blocks in any pool order), with views
    that change now and then: every plan ``PlanCarry`` gives is ``plan_runs``' plan for
    that step, whether it was grown or planned afresh."""
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block size")
    n_max = 12
    table = np.array(data.draw(st.permutations(range(n_max * 2)), label="pool")[:n_max])
    table.flags.writeable = False
    carry, grown = PlanCarry(), 0
    length = data.draw(st.integers(1, bs * 3), label="start")
    view: tuple[int, ...] | None = None
    while length <= n_max * bs:
        n = -(-length // bs)
        if data.draw(st.booleans(), label="new view"):
            view = data.draw(st.one_of(st.none(), st.lists(st.integers(0, n - 1)).map(
                lambda b, n=n: tuple(sorted({*b, n - 1})))), label="view")
        elif view is not None and view[-1] != n - 1:
            view = (*view, n - 1)  # a view always keeps the newest block
        keep = range(n) if view is None else view
        want = plan_runs(table[:n], keep, 0, length, bs, "cpu")
        got = carry.grown(7, view_key(view), length, table, bs)
        grown += got is not None
        assert got is None or _same(got, want)
        carry.keep({7: Carried(view_key(view), length, table, got or want)})
        length += 1
    assert len(carry) == 1


def test_a_plan_is_carried_only_while_view_table_and_newest_block_hold() -> None:
    table = np.array([5, 2, 9])
    plan = plan_runs(table, [0, 2], 0, 34, 16, "cpu")
    carry = PlanCarry()
    carry.keep({1: Carried((0, 2), 34, table, plan)})
    assert _same(carry.grown(1, (0, 2), 35, table, 16), plan_runs(table, [0, 2], 0, 35, 16, "cpu"))
    assert carry.grown(1, view_key([0, 2]), 35, table, 16) is not None  # equal, not the same
    assert carry.grown(1, (0, 1, 2), 35, table, 16) is None  # another view
    assert carry.grown(1, None, 35, table, 16) is None
    assert carry.grown(1, (0, 2), 35, table.copy(), 16) is None  # the table changed
    assert carry.grown(1, (0, 2), 36, table, 16) is None  # a step was skipped
    assert carry.grown(2, (0, 2), 35, table, 16) is None  # another sequence
    carry.keep({1: Carried((0, 2), 48, table, plan_runs(table, [0, 2], 0, 48, 16, "cpu"))})
    assert carry.grown(1, (0, 2), 49, table, 16) is None  # the new row opens block 3
    carry.drop(1)
    assert len(carry) == 0 and carry.grown(1, (0, 2), 49, table, 16) is None
