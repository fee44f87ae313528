"""Paged attention: the ``AttentionFn`` that reads only the KV blocks of a sequence's view.

This is where Declarative Attention saves work. A decode row on a global layer never
gathers the whole context: its kept blocks are planned into runs once per step
(``runs.py``), read by the decode kernels (``decode.py``), and what was read is recorded
in a ``ReadCounter`` (``reads.py``) so the claim can be tested rather than assumed.
Prefill rows (and chunked prefill) attend causally over every stored position
(``prefill.py``): every mode reads the whole prompt while it is being filled in.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from declattn.engine.attention_api import DecodeReads, PlannedDecode
from declattn.engine.decode import (
    MIN_SPLIT_ROWS,
    Kernel,
    RunBatch,
    decode_batch,
    resolve_kernel,
)
from declattn.engine.kv import KVCache, inverse_table
from declattn.engine.prefill import prefill_attention, viewed_prefill_attention
from declattn.engine.reads import ReadCounter
from declattn.engine.runs import PlanMemo, RunPlan, checked_view, plan_runs, union_rows
from declattn.engine.seq_step import SeqStep


@dataclass
class _SeqPlan:
    step: SeqStep
    row: int
    table: np.ndarray
    # The cache's array of the sequence's whole table (``table`` is its first blocks):
    # the same object until the table changes, which is what ``PlanMemo`` checks.
    whole_table: np.ndarray
    # Prefill rows: pool rows of positions [0, length), a (lo, hi) range when the
    # sequence's blocks are physically consecutive (a zero-copy slice), else an index.
    key_rows: tuple[int, int] | Tensor | None = None

    @functools.cached_property
    def inverse(self) -> np.ndarray:
        """The logical index of each physical block of ``table`` (``inverse_table``), with
        which a plan names the blocks its reads cover; made when a plan needs it."""
        return inverse_table(self.table)

    def keys(self, pool: Tensor, lo: int, hi: int) -> Tensor:
        """Pool rows of positions ``[lo, hi)`` as ``[Hkv, hi - lo, D]``."""
        rows = self.key_rows
        assert rows is not None, "only prefill rows read keys this way"
        if isinstance(rows, tuple):
            return pool[:, rows[0] + lo : rows[0] + hi]
        return pool.index_select(1, rows[lo:hi])


@dataclass
class _DecodeRow:
    """One decode row: the sequence it extends, its row in the step, its place among that
    sequence's rows of the step (forced tokens put several there), the positions it may
    read (its own included), and the runs it reads."""

    seq: _SeqPlan
    row: int
    index: int
    length: int
    global_runs: RunPlan
    window_runs: dict[int, RunPlan] = field(default_factory=dict)


def _continues(before: SeqStep, after: SeqStep) -> bool:
    """Whether ``after`` may follow ``before`` of the same sequence in one step: decode
    rows right after the prefill piece that completes its prompt (``scheduler.py``)."""
    return not before.is_decode and after.is_decode and after.start == before.length


def _consecutive(table: np.ndarray) -> bool:
    return table.size < 2 or bool((np.diff(table) == 1).all())


def _as_rows(slots: list[Tensor], native: bool = False) -> Tensor | slice:
    """The step's new pool rows; on the torch path one consecutive range becomes a slice
    (a plain copy instead of an indexed write, which matters once per layer per decode
    step); the ``native`` store takes the rows as they are."""
    if not slots:
        return torch.empty(0, dtype=torch.int64)
    rows = torch.cat(slots) if len(slots) > 1 else slots[0]
    if native:
        return rows
    lo, n = int(rows[0]), rows.numel()
    if int(rows[-1]) == lo + n - 1 and (n < 3 or bool((rows.diff() == 1).all())):
        return slice(lo, lo + n)
    return rows


class PagedAttention(PlannedDecode):
    """``AttentionFn`` over a ``KVCache`` for one batch step of several sequences.

    Construct one per step (after ``cache.allocate`` covers every ``start + n_new``);
    the model calls it once per layer. Each call stores the step's new k/v, then
    attends: prefill rows causally over everything, decode rows on global layers over
    the view's blocks only, decode rows on sliding layers over the last ``window``
    positions. Everything that depends only on the step (run plans, slot maps, the
    batch of runs the decode kernel reads) is worked out here, once, and shared by every
    layer; all decode rows of a layer go to the kernel in one call (``decode.py``).
    """

    def __init__(
        self,
        cache: KVCache,
        steps: Sequence[SeqStep],
        counter: ReadCounter | None = None,
        *,
        kernel: Kernel = "auto",
        placement_invariant: bool = False,
        memo: PlanMemo | None = None,
    ) -> None:
        """``kernel`` forces a decode path (``native`` or ``torch``) where a benchmark or a
        test compares them; the engine leaves it on ``auto``. ``placement_invariant``:
        decode rows' results must not depend on where their blocks sit (see
        ``decode_batch``); batch-invariant mode asks for it. ``memo``: the last step's
        plans, which a decode row one position on extends (the engine keeps one)."""
        self.cache = cache
        self.memo = memo
        self.counter = counter
        self.kernel = resolve_kernel(kernel, cache.k[0])
        self.placement_invariant = placement_invariant
        self._bytes_per_token = cache.config.bytes_per_token  # a property that allocates
        self._device = str(cache.config.device)
        bs = cache.block_size
        seen: dict[int, SeqStep] = {}
        plans: list[_SeqPlan] = []
        decode: list[_DecodeRow] = []
        new_slots: list[Tensor] = []
        row = 0
        for st in steps:
            before = seen.get(st.seq_id)
            if before is not None and not _continues(before, st):
                raise ValueError(f"sequence {st.seq_id} appears twice in one step")
            seen[st.seq_id] = st
            if st.start < 0 or st.n_new < 1:
                raise ValueError(f"bad step for sequence {st.seq_id}: {st}")
            if cache.capacity(st.seq_id) < st.length:
                raise ValueError(
                    f"sequence {st.seq_id} has {cache.capacity(st.seq_id)} slots, needs "
                    f"{st.length}: call cache.allocate first"
                )
            n_blocks = -(-st.length // bs)
            whole = cache.block_array(st.seq_id)
            plan = _SeqPlan(st, row, whole[:n_blocks], whole)
            if st.is_decode:
                decode += self._decode_rows_of(plan)
                new_slots.append(cache.slots(st.seq_id, st.start, st.length))
            elif _consecutive(plan.table):
                first = int(plan.table[0]) * bs
                plan.key_rows = (first, first + st.length)
                new_slots.append(
                    torch.arange(first + st.start, first + st.length, device=self._device)
                )
            else:
                slots = cache.slots(st.seq_id, 0, st.length)
                plan.key_rows = slots
                new_slots.append(slots[st.start :])
            plans.append(plan)
            row += st.n_new
        self._plans = plans
        self._n_rows = row
        self._decode = decode
        self._decode_index = _as_rows(
            [torch.tensor([d.row for d in decode], dtype=torch.int64)] if decode else []
        )
        self._selecting = any(p.step.select is not None for p in plans)
        self._batches: dict[int | None, tuple[RunBatch, list[int]]] = {}
        self._new_slots = _as_rows(new_slots, native=cache.stores_natively())
        self.step = counter.begin_step() if counter is not None else -1

    def _decode_rows_of(self, plan: _SeqPlan) -> list[_DecodeRow]:
        """The decode rows of a sequence's step: one, or its newest token and the forced
        tokens after it (``SeqStep.row_views``), each over its own view up to its own
        position. Every row's K/V is stored before any row attends, so row ``i`` reads
        rows ``0 .. i - 1`` of its own step as it reads older positions."""
        st = plan.step
        views = (st.view,) if st.n_new == 1 else st.row_views
        if views is None or len(views) != st.n_new or (st.n_new > 1 and st.select is not None):
            raise ValueError(
                f"decode rows of sequence {st.seq_id} need a view per row and no selection"
            )
        out = []
        for i, view in enumerate(views):
            length = st.start + i + 1
            fresh = functools.partial(self._fresh_runs, plan, view, length)
            if self.memo is not None and st.n_new == 1:
                runs = self.memo.plan(st.seq_id, plan.whole_table, view, length, fresh)
            else:
                runs = fresh()
            out.append(_DecodeRow(plan, plan.row + i, i, length, runs))
        return out

    def _fresh_runs(self, plan: _SeqPlan, view: Sequence[int] | None, length: int) -> RunPlan:
        """The runs of a decode row of ``plan``'s sequence at ``length`` over ``view``."""
        bs = self.cache.block_size
        n_blocks = -(-length // bs)
        keep = range(n_blocks) if view is None else checked_view(plan.step.seq_id, view, n_blocks)
        return plan_runs(plan.table, keep, 0, length, bs, self._device, plan.inverse)

    def _selected_runs(self, d: _DecodeRow, layer: int, q: Tensor) -> RunPlan:
        """The runs of the blocks ``d``'s step's ``select`` picks for this layer and query."""
        st = d.seq.step
        assert st.select is not None
        blocks = st.select(layer, q)
        if blocks is None:  # the controller defers to its view on this layer
            return d.global_runs
        n_blocks = len(d.seq.table)
        keep = checked_view(st.seq_id, blocks, n_blocks)
        return plan_runs(d.seq.table, keep, 0, d.length, self.cache.block_size, self._device)

    def _window_runs(self, d: _DecodeRow, window: int) -> RunPlan:
        runs = d.window_runs.get(window)
        if runs is None:
            lo = max(0, d.length - window)
            bs = self.cache.block_size
            keep = range(lo // bs, -(-d.length // bs))
            runs = plan_runs(d.seq.table, keep, lo, d.length, bs, self._device, d.seq.inverse)
            d.window_runs[window] = runs
        return runs

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
        if q.shape[0] != self._n_rows or k.shape[0] != self._n_rows:
            raise ValueError(f"step has {self._n_rows} rows, got q {tuple(q.shape)}")
        if window is not None and window < 1:
            raise ValueError("window must be >= 1")
        self.cache.write(layer, self._new_slots, k, v)
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        if len(self._decode) == self._n_rows:  # a pure decode step
            return self._attend_decode(layer, kp, vp, q, scale, window)
        if len(self._plans) == 1:  # one prefill piece
            return self._prefill(self._plans[0], kp, vp, q, scale, window)
        out = torch.empty_like(q)
        for plan in self._plans:
            st, r = plan.step, plan.row
            if not st.is_decode:
                out[r : r + st.n_new] = self._prefill(
                    plan, kp, vp, q[r : r + st.n_new], scale, window
                )
        if self._decode:
            rows = self._decode_index
            out[rows] = self._attend_decode(layer, kp, vp, q[rows], scale, window, q)
        return out

    def _attend_decode(
        self,
        layer: int,
        kp: Tensor,
        vp: Tensor,
        q: Tensor,
        scale: float,
        window: int | None,
        q_step: Tensor | None = None,
    ) -> Tensor:
        """The decode rows' attention (``q``: theirs only; ``q_step``: the whole step's,
        where a selection hook needs a row's query by its step row)."""
        batch, n_rows = self._batch(layer, q if q_step is None else q_step, window)
        self._record((layer,), batch, n_rows, window is not None)
        return decode_batch(kp, vp, q, batch, scale, self.kernel, self.placement_invariant)

    def decode_reads(self, windows: Sequence[int | None]) -> DecodeReads | str | None:
        """This step's reads on every layer for a native layer runner (``PlannedDecode``):
        a pure decode step with no query-aware selection, on the native kernels."""
        if not self._decode or len(self._decode) != self._n_rows:
            return None
        if len(windows) != len(self.cache.k):
            raise ValueError(f"{len(windows)} windows for {len(self.cache.k)} layers")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError("window must be >= 1")
        if self._selecting:
            return "query-aware selection (a layer's blocks depend on its query)"
        if self.kernel != "native":
            return "decode attention on the torch kernel"
        if not self.cache.stores_natively():
            return "a KV pool the native store does not write"
        batches = [self._shared_batch(w) for w in windows]
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            by_window.setdefault(window, []).append(layer)

        def record() -> None:  # the layers of one window share its batch
            for window, layers in by_window.items():
                self._record(layers, *self._shared_batch(window), window is not None)

        rows = self._new_slots
        assert isinstance(rows, Tensor), "a native store takes the rows as a tensor"
        return DecodeReads(
            self._n_rows, list(self.cache.k), list(self.cache.v), rows,
            [b.runs for b, _ in batches], [b.offsets for b, _ in batches], MIN_SPLIT_ROWS,
            record,
        )

    def _shared_batch(self, window: int | None) -> tuple[RunBatch, list[int]]:
        """The runs of every decode row on a global (``None``) or window layer without
        query-aware selection, and the pool rows each is counted for: one batch per step
        and kind of layer."""
        if window not in self._batches:
            runs = [
                d.global_runs if window is None else self._window_runs(d, window)
                for d in self._decode
            ]
            self._batches[window] = (RunBatch.of(runs), self._counted_rows(runs))
        return self._batches[window]

    def _batch(self, layer: int, q: Tensor, window: int | None) -> tuple[RunBatch, list[int]]:
        """The runs of every decode row on this layer, as one kernel call reads them.
        Global and window layers reuse one batch per step; query-aware selection plans
        its rows afresh on every layer (one row per sequence: a step that selects has no
        forced rows)."""
        if window is not None or not self._selecting:
            return self._shared_batch(window)
        runs = [
            self._selected_runs(d, layer, q[d.row]) if d.seq.step.select is not None
            else d.global_runs
            for d in self._decode
        ]
        return RunBatch.of(runs), [r.n_rows for r in runs]

    def _counted_rows(self, runs: Sequence[RunPlan]) -> list[int]:
        """The pool rows each decode row's reads count. A row alone counts its runs. The
        rows of one sequence (its newest token and the forced tokens after it) walk
        overlapping runs one after another in one kernel call, the later walks over rows
        the first has just brought into cache: their union counts once, on the first."""
        out = [r.n_rows for r in runs]
        i = 0
        while i < len(runs):
            n = self._decode[i].seq.step.n_new
            if n > 1:
                out[i : i + n] = [union_rows(runs[i : i + n])] + [0] * (n - 1)
            i += n
        return out

    def _record(
        self, layers: Sequence[int], batch: RunBatch, n_rows: list[int], sliding: bool
    ) -> None:
        """Each decode row's reads on ``layers``, which all read ``batch``."""
        if self.counter is None:
            return
        per_token = self._bytes_per_token
        for d, runs, rows in zip(self._decode, batch.plans, n_rows, strict=True):
            self.counter.record_layers(
                layers, self.step, d.seq.step.seq_id, d.index, runs.blocks, rows * per_token,
                sliding,
            )

    def _prefill(
        self, plan: _SeqPlan, kp: Tensor, vp: Tensor, q: Tensor, scale: float, window: int | None
    ) -> Tensor:
        st = plan.step
        if window is None and st.row_views is not None and any(st.row_views):
            return viewed_prefill_attention(
                q, plan.keys(kp, 0, st.length), plan.keys(vp, 0, st.length), st.start, scale,
                st.row_views, self.cache.block_size,
            )
        lo = 0 if window is None else max(0, st.start - window + 1)
        return prefill_attention(
            q,
            plan.keys(kp, lo, st.length),
            plan.keys(vp, lo, st.length),
            st.start,
            scale,
            window,
        )
