"""Run planning: which pool rows one decode row reads, grouped so that reading is cheap.

A view is a set of logical blocks; the pool stores them wherever they were allocated.
Planning turns the kept blocks into maximal runs of physically consecutive rows, and
names the logical blocks those reads cover, so the read counter is derived from what is
read, not from what was asked for. Everything here depends only on the step, never on the
layer: a plan is worked out once per step and shared by every layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from declattn.engine.kv import inverse_table

# The torch fallback gathers runs up to this many rows together rather than slicing
# them one by one...
_GATHER_RUN_ROWS = 128
# ...when there are at least this many of them (a few runs cost less as slices).
_GATHER_MIN_RUNS = 8


def sorted_unique(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a sorted int64 array without repeats. Already strictly increasing
    (every session's view, and the blocks of runs in logical order) it is taken as it is:
    ``np.unique`` sorts, and these arrays are made every decode step."""
    a = np.asarray(values, dtype=np.int64)
    if a.size > 1 and not bool((a[1:] > a[:-1]).all()):
        a = np.unique(a)
    return a


def checked_view(seq_id: int, view: Sequence[int], n_blocks: int) -> np.ndarray:
    """``view`` of a decode row reading ``n_blocks`` blocks, sorted and unique; a
    ``ValueError`` if it names a block outside them or misses the newest one."""
    keep = sorted_unique(view)
    if keep.size and (keep[0] < 0 or keep[-1] >= n_blocks):
        raise ValueError(f"view of sequence {seq_id} names blocks outside [0, {n_blocks})")
    if not keep.size or keep[-1] != n_blocks - 1:
        raise ValueError(
            f"view of sequence {seq_id} misses block {n_blocks - 1}, "
            "which holds the newest token"
        )
    return keep


def _expand(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], stops[i])``, vectorised."""
    lengths = stops - starts
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(int(lengths.sum()))


@dataclass(frozen=True)
class Pieces:
    """A plan's rows as the torch fallback reads them: zero-copy slices, plus one gather
    of short whole blocks (``None`` when there are too few to be worth it)."""

    slices: tuple[tuple[int, int], ...]
    gather: Tensor | None


@dataclass(frozen=True, eq=False)
class RunPlan:
    """The pool rows one decode row reads, and the logical blocks they cover.

    ``rows`` are ``[n, 2]`` int64 ranges ``[start, stop)`` of pool rows, in physical
    order: the fused kernel walks them as they are, a run costing a few pointers.
    ``blocks`` is derived from those rows, not from the view asked for, so a counter fed
    from a plan records what is read.
    """

    block_size: int
    rows: np.ndarray
    blocks: tuple[int, ...]
    n_rows: int
    device: str = "cpu"

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[tuple[int, int]] | np.ndarray,
        block_size: int,
        table: Sequence[int] | None = None,
        device: str = "cpu",
        inverse: np.ndarray | None = None,
    ) -> RunPlan:
        """Plan the reads of pool ``rows``; ``table`` (physical id of each logical
        block), or its ``inverse`` (logical index of each physical block, -1 for none),
        lets the plan name the logical blocks its reads cover."""
        bs = block_size
        r = np.ascontiguousarray(np.asarray(rows, dtype=np.int64).reshape(-1, 2))
        blocks: tuple[int, ...] = ()
        if inverse is None and table is not None:
            inverse = inverse_table(np.asarray(table, dtype=np.int64))
        if inverse is not None:
            ids = sorted_unique(inverse[_expand(r[:, 0] // bs, (r[:, 1] - 1) // bs + 1)])
            blocks = tuple(ids.tolist())
        return cls(bs, r, blocks, int((r[:, 1] - r[:, 0]).sum()), device)

    @functools.cached_property
    def row_index(self) -> Tensor:
        """Every pool row the plan reads, in its order (for one gather of them all)."""
        return torch.from_numpy(_expand(self.rows[:, 0], self.rows[:, 1])).to(self.device)

    @functools.cached_property
    def pieces(self) -> Pieces:
        """The rows split for the torch fallback. Short runs of whole blocks (left
        isolated by interleaved growth) are gathered together with one
        ``index_select``: it reads the same bytes, and a matmul per tiny run would cost
        far more in call overhead than the copy does."""
        bs, r = self.block_size, self.rows
        whole = (r[:, 0] % bs == 0) & (r[:, 1] % bs == 0)
        short = whole & (r[:, 1] - r[:, 0] <= _GATHER_RUN_ROWS)
        if short.sum() < _GATHER_MIN_RUNS:
            short[:] = False
        slices = tuple((int(x), int(y)) for x, y in r[~short])
        gathered = _expand(r[short, 0] // bs, r[short, 1] // bs)
        gather = torch.from_numpy(gathered).to(self.device) if gathered.size else None
        return Pieces(slices, gather)


def union_rows(plans: Sequence[RunPlan]) -> int:
    """Distinct pool rows the ``plans`` read together (their ranges merged): what rows of
    one sequence that walk overlapping runs in one call read from memory."""
    if len(plans) == 1:
        return plans[0].n_rows
    r = np.concatenate([p.rows for p in plans])
    if not r.size:
        return 0
    r = r[np.argsort(r[:, 0], kind="stable")]
    reach = np.maximum.accumulate(r[:, 1])  # the furthest row covered so far
    starts = np.maximum(r[1:, 0], reach[:-1])  # a range counts only past what came before
    return int(r[0, 1] - r[0, 0] + np.maximum(0, r[1:, 1] - starts).sum())


def plan_runs(
    table: Sequence[int],
    keep: Sequence[int],
    lo: int,
    hi: int,
    bs: int,
    device: str,
    inverse: np.ndarray | None = None,
) -> RunPlan:
    """Group kept logical blocks into maximal runs of consecutive physical rows.

    Only positions in ``[lo, hi)`` are valid; a partial block ends (or starts) its run
    so that a run is one plain slice. Runs follow logical order: attention is order-free
    over keys in exact arithmetic, but not in fp32, and the kernels sum the rows in the
    order of their runs. In logical order a sequence's attention depends only on its
    tokens, never on where its blocks happen to sit in the pool (which depends on what
    else ran beside it), so batch-invariant mode gives bit-equal results; physical order
    made them differ once a freed block was reused below a sequence's earlier ones.
    Vectorised: a 64K-token view has thousands of blocks and is planned every step.
    """
    tab = np.asarray(table, dtype=np.int64)
    lb = sorted_unique(keep)
    a = np.maximum(0, lo - lb * bs)
    b = np.minimum(bs, hi - lb * bs)
    valid = a < b
    phys, a, b = tab[lb[valid]], a[valid], b[valid]
    if phys.size == 0:
        return RunPlan(bs, np.zeros((0, 2), dtype=np.int64), (), 0, device)
    # A block continues the previous run only if it is the next physical block, the
    # previous one was read to its end, and this one is read from its start.
    cont = np.zeros(phys.size, dtype=bool)
    cont[1:] = (phys[1:] == phys[:-1] + 1) & (b[:-1] == bs) & (a[1:] == 0)
    starts = np.flatnonzero(~cont)
    ends = np.append(starts[1:], phys.size) - 1
    rows = np.stack([phys[starts] * bs + a[starts], phys[ends] * bs + b[ends]], axis=1)
    return RunPlan.from_rows(rows, bs, table, device, inverse)


@dataclass
class _Planned:
    table: np.ndarray
    view: Sequence[int] | None
    length: int
    runs: RunPlan


class PlanMemo:
    """Each sequence's decode plan of the last step, so that this step's extends it.

    A decode step mostly reads the view the last one read, one position further: the
    same kept blocks, the newest of which grows by a row. Its plan is then the last one
    with the final run one row longer (the newest block is always kept and always
    read last, so the final run ends at the newest position), and planning afresh costs
    a few dozen numpy calls a row on every step. Anything else plans afresh: another
    table (``KVCache.block_array`` makes a new array whenever a table changes), another
    view, another block count, or any other length. Only the sequences planned in the
    last step are kept (``next_step``), so finished ones leave at once.
    """

    def __init__(self) -> None:
        self._last: dict[int, _Planned] = {}
        self._this: dict[int, _Planned] = {}

    def next_step(self) -> None:
        """Start a step: what was planned in the step before it may be extended."""
        self._last, self._this = self._this, {}

    def plan(
        self,
        seq_id: int,
        table: np.ndarray,
        view: Sequence[int] | None,
        length: int,
        fresh: Callable[[], RunPlan],
    ) -> RunPlan:
        """The runs of ``seq_id``'s decode row at ``length`` over ``view`` (``table``: the
        cache's whole array of the sequence), extended from the last step's or ``fresh``."""
        last = self._last.get(seq_id)
        if last is not None and _extends(last, table, view, length):
            old = last.runs
            rows = old.rows.copy()
            rows[-1, 1] += 1
            runs = RunPlan(old.block_size, rows, old.blocks, old.n_rows + 1, old.device)
        else:
            runs = fresh()
        self._this[seq_id] = _Planned(table, view, length, runs)
        return runs


def _extends(last: _Planned, table: np.ndarray, view: Sequence[int] | None, length: int) -> bool:
    """Whether a row at ``length`` over ``view`` reads ``last``'s runs and one row more."""
    bs = last.runs.block_size
    return (
        length == last.length + 1
        and (length - 1) // bs == (last.length - 1) // bs  # the newest block is the same
        and last.table is table
        and (last.view is view or (last.view is not None and view is not None
                                   and tuple(last.view) == tuple(view)))
        and last.runs.rows.size > 0
    )
