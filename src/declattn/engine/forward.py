"""One step's model call: the rows a ``StepPlan`` names, through the model, in one forward.

Rows go in plan order: the prefill piece first (and, where it completes its sequence,
the rows of the tokens the sequence holds past it), then each decoding sequence's rows
(its newest token, after the forced tokens waiting before it, if any). The piece first keeps
its rows where they sit when it runs alone, so its K/V does not depend on the decode rows
beside it (the projections of a row do not depend on the other rows of the call). Each
decode row is given its view here, just before the forward, as a decode step always
was; the views of rows before it were asked for as their forced tokens were accepted.

``batch_invariant``: every sequence's rows are a model call of their own, so what a
sequence computes never depends on who else is in the step (a batched matmul may pick
its kernel, and so its rounding, by the number of rows), for the weights read once per
sequence instead of once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from declattn.engine.kv import KVCache
from declattn.engine.models import Decoder
from declattn.engine.models.token_context import TokenContext, token_context
from declattn.engine.paged import PagedAttention
from declattn.engine.reads import ReadCounter
from declattn.engine.request import Request, StepRead
from declattn.engine.runs import PlanMemo
from declattn.engine.scheduler import StepPlan
from declattn.engine.seq_step import SeqStep

View = tuple[int, ...] | None


@dataclass
class Rows:
    """One sequence's rows in a forward, and what came out of them: ``logits`` of its
    last row when it samples next, ``reads`` of each decode row."""

    seq: Request
    step: SeqStep
    decode: bool
    samples: bool
    with_prefill: bool = False
    """Decode rows riding the forward that completes the sequence's prompt."""
    logits: Tensor | None = None
    seconds: float = 0.0


def recomputed_views(seq: Request, start: int, stop: int, block_size: int) -> tuple[View, ...]:
    """The view of each position in ``[start, stop)`` that a recompute computes: ``None``
    for a prompt position (prefill reads everything), for an output position the blocks its
    decode row read (``None`` where it read them all), so a preempted sequence's K/V comes
    back as its own views made it."""
    n = len(seq.prompt_ids)
    views: list[View] = [None] * max(0, min(stop, n) - start)
    for p in range(max(start, n), stop):
        read = seq.reads[p - n]
        full = not read.blocks or len(read.blocks) == -(-read.length // block_size)
        views.append(None if full else read.blocks)
    return tuple(views)


class Forward:
    """Runs the model over a step's rows and reads back what each decode row read."""

    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        counter: ReadCounter,
        *,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.counter = counter
        self.batch_invariant = batch_invariant
        self.device = next(model.parameters()).device
        c = model.config
        self._global_layers = [i for i in range(c.num_layers) if c.window(i) is None]
        self._plans = PlanMemo()

    def run(self, plan: StepPlan) -> list[Rows]:
        """The plan's rows through the model: each ``Rows`` with its logits (where it
        samples) and, for decode rows, their reads appended to the sequence's."""
        rows = self._rows(plan)
        self._plans.next_step()
        groups = [[r] for r in rows] if self.batch_invariant else [rows]
        for group in groups:
            if group:
                self._call(group)
        for r in rows:
            if r.decode:
                r.seq.pending_views.clear()
        return rows

    def _rows(self, plan: StepPlan) -> list[Rows]:
        bs = self.cache.block_size
        out = []
        if plan.prefill is not None:
            p = plan.prefill
            views = recomputed_views(p.seq, p.start, p.stop, bs)
            step = SeqStep(p.seq.seq_id, p.start, p.stop - p.start,
                           row_views=views if any(views) else None, prefill=True)
            out.append(Rows(p.seq, step, False, p.last and not p.seq.output_ids))
            if p.last and p.seq.length > p.stop and p.seq.finish_reason is None:
                # tokens it holds past the piece (forced at its start, or waiting when it
                # was preempted): their rows run now, and it samples from the last
                out.append(Rows(p.seq, self._decode_step(p.seq), True, True, with_prefill=True))
        for seq in plan.decode:
            out.append(Rows(seq, self._decode_step(seq), True, True))
        return out

    @staticmethod
    def _decode_step(seq: Request) -> SeqStep:
        """The rows of ``seq`` from its ``kv_length`` to its newest token, the last row's
        view asked for now (positions read: all stored plus its own)."""
        start, stop = seq.kv_length, seq.length
        ctl = seq.controller
        if len(seq.pending_views) != stop - start - 1:
            raise RuntimeError(f"sequence {seq.seq_id}: {len(seq.pending_views)} waiting views "
                               f"for {stop - start} rows")
        view = ctl.view(stop)
        if stop - start == 1:
            select = ctl.select_blocks if ctl.selects_blocks else None
            return SeqStep(seq.seq_id, start, 1, view, select)
        views = (*seq.pending_views, None if view is None else tuple(view))
        return SeqStep(seq.seq_id, start, stop - start, row_views=views, decode_rows=True)

    def _call(self, group: list[Rows]) -> None:
        """One model call over ``group``'s rows."""
        t0 = time.perf_counter()
        steps = [r.step for r in group]
        ids = torch.tensor([t for r in group for t in _ids(r.seq, r.step)], device=self.device)
        pos = torch.tensor([p for s in steps for p in range(s.start, s.length)],
                           device=self.device)
        attn = PagedAttention(
            self.cache, steps, self.counter, placement_invariant=self.batch_invariant,
            memo=self._plans,
        )
        hidden = self.model(ids, pos, attn, self._context(group))
        ends = list(accumulate(s.n_new for s in steps))  # one past each sequence's rows
        sampled = [i for i, r in enumerate(group) if r.samples]
        rows = [ends[i] - 1 for i in sampled]
        logits = self.model.logits(hidden[rows], fp32=False) if rows else None
        elapsed = time.perf_counter() - t0
        for k, i in enumerate(sampled):
            assert logits is not None
            group[i].logits = logits[k]
        for r in group:
            r.seconds = elapsed
            if r.decode:
                r.seq.reads.extend(self._harvest(attn.step, r, elapsed))

    def _context(self, group: list[Rows]) -> TokenContext | None:
        """Neighbours and chunk ids of the step's tokens, for models that need them."""
        config = self.model.config
        if not config.needs_token_context:
            return None
        parts = []
        for r in group:
            seq, positions = r.seq, range(r.step.start, r.step.length)
            lo = max(0, positions.start - config.token_shift)
            regions = seq.controller.regions(lo, positions.stop)
            ids = seq.token_ids[lo : positions.stop]
            shift = config.token_shift
            parts.append(token_context(ids, regions, positions, shift, lo, self.device))
        return TokenContext.cat(parts)

    def _harvest(self, step: int, r: Rows, elapsed: float) -> list[StepRead]:
        """One ``StepRead`` per decode row of ``r``, from the read counter."""
        seq, st, counter = r.seq, r.step, self.counter
        n = len(seq.prompt_ids)
        out = []
        for i in range(st.n_new):
            per_layer = [
                counter.blocks_read(step, seq.seq_id, layer, row=i) or ()
                for layer in self._global_layers
            ]
            out.append(StepRead(
                index=st.start + i + 1 - n,
                length=st.start + i + 1,
                blocks=per_layer[0] if per_layer else (),
                layers_agree=all(b is per_layer[0] or b == per_layer[0] for b in per_layer),
                global_bytes=counter.row_bytes(step, seq.seq_id, i),
                sliding_bytes=counter.row_bytes(step, seq.seq_id, i, sliding=True),
                seconds=elapsed,
                forced=i < st.n_new - 1 or r.with_prefill,
            ))
        return out


def _ids(seq: Request, step: SeqStep) -> list[int]:
    """The input tokens of ``step``'s rows (without building the whole token list where
    they are all outputs, as decode rows are)."""
    n = len(seq.prompt_ids)
    if step.start >= n:
        return seq.output_ids[step.start - n : step.length - n]
    return seq.token_ids[step.start : step.length]
