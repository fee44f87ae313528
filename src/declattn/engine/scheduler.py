"""Which rows the next step computes, and the blocks they need.

A step is one forward. By default (mixed steps) it carries a decode row of every running
sequence (several where forced tokens wait: ``Controller.forced``) and, beside them, one
piece of the first waiting prompt, so running streams keep decoding while a prompt
prefills: a step costs its piece plus its decode rows, never a whole long prefill.
``prefill_first`` keeps the older rule, for comparison: a step is either a piece of the
first waiting prompt (whenever it has room) or one decode row of every running sequence.

The step that completes a sequence's prompt (or its recompute) also runs the rows of the
tokens it already holds past it: tokens its controller forced before its first sample
(``Controller.forced``, asked at admission), or, for a preempted sequence, its newest
token and the forced ones waiting with it. Their K/V is stored with the piece's, and
the sequence samples from its last row, so it needs no decode step of its own first.

A piece never crosses a multiple of the prefill chunk, and inside a chunk it is cut at
multiples of the budget (``prefill_budget`` rows at the prompt's start, fewer further in
as each row's attention grows: ``row_cost.py``), so where a piece starts depends on the
engine's settings and the model only, never on who else runs: a cached prefix then
gives bit for bit what a fresh prefill gives (``prefix.py``). Decode rows do not count
against the budget: every running stream advances every step.

Blocks are taken as sequences grow. A waiting prompt whose piece the pool cannot hold
waits while the running ones decode (and finish, freeing blocks); decode rows the pool
cannot hold preempt the sequence holding the most blocks, which later resumes by
recompute under the views it decoded with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from declattn.engine.kv import KVCache, PoolExhausted
from declattn.engine.prefix import PromptCache
from declattn.engine.request import Request
from declattn.engine.row_cost import RowCost


@dataclass(frozen=True)
class Piece:
    """Positions ``[start, stop)`` of a waiting sequence that a step computes (its
    prompt, or for a preempted sequence everything it held); ``last``: they complete it."""

    seq: Request
    start: int
    stop: int
    last: bool


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step: a piece of a waiting sequence, and the running sequences
    that decode (each from ``kv_length`` to its newest token)."""

    prefill: Piece | None
    decode: tuple[Request, ...]

    @property
    def requests(self) -> list[Request]:
        head = [self.prefill.seq] if self.prefill is not None else []
        return head + list(self.decode)


class Scheduler:
    """The waiting and running sequences over one KV cache, and each step's plan."""

    def __init__(
        self,
        cache: KVCache,
        prompts: PromptCache,
        release: Callable[[Request], None],
        *,
        prefill_chunk: int,
        prefill_budget: int,
        prefill_first: bool = False,
        row_cost: RowCost | None = None,
    ) -> None:
        """``release`` frees a sequence's blocks and whatever else the engine keeps
        for it (its carried decode plan); ``row_cost`` shrinks the budget further into a
        prompt (``None``: the same number of rows everywhere)."""
        if prefill_budget < 1:
            raise ValueError("prefill_budget must be >= 1")
        self.cache = cache
        self.prompts = prompts
        self.release = release
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.prefill_first = prefill_first
        self.row_cost = row_cost
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    # -- the plan ------------------------------------------------------------------
    def next_requests(self) -> list[Request]:
        """The sequences the next step works on, decided as ``schedule`` will (a
        preemption while making room may still change it)."""
        head = self._head()
        if self.prefill_first and head is not None:
            return [head]
        return ([head] if head is not None else []) + list(self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan, with blocks for all of its rows."""
        if self.prefill_first:
            head = self._head()
            if head is not None:
                return StepPlan(self._start(head), ())
            return StepPlan(None, tuple(self._make_room(list(self.running))))
        decode = self._make_room(list(self.running))
        head = self._head()
        piece = self._start(head) if head is not None else None
        return StepPlan(piece, tuple(s for s in decode if s in self.running))

    def _head(self) -> Request | None:
        """The waiting sequence whose piece the next step computes, if any: the first,
        when its piece has room (or nothing runs that could free some)."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        return head if not self.running or self._fits(head) else None

    def target(self, seq: Request) -> int:
        """Positions to fill before ``seq`` decodes: its prompt, or, for a preempted
        sequence, every position whose row had run (the rest are its next decode rows)."""
        return seq.kv_length if seq.output_ids else len(seq.prompt_ids)

    def piece_stop(self, start: int, target: int) -> int:
        """Where a piece from ``start`` ends: at the target, the next multiple of the
        chunk, or the next multiple of the chunk's budget inside it, whichever is first."""
        chunk, budget = self.prefill_chunk, self.prefill_budget
        base = start - start % chunk
        if self.row_cost is not None:
            budget = self.row_cost.piece(budget, base)
        cut = base + min(chunk, ((start - base) // budget + 1) * budget)
        return min(target, cut)

    def _fits(self, seq: Request) -> bool:
        """Whether ``seq``'s next piece has room, keeping one block per running sequence
        free so that starting it does not at once preempt another. A preempted sequence
        resumes only when all it must recompute fits, plus its next rows: resuming part
        way would only get it preempted again."""
        target = self.target(seq)
        if seq.preemptions:
            stop = max(seq.length + len(seq.opening), target + 1)
        else:
            stop = self.blocks_to(seq, self.piece_stop(seq.prefilled, target), target)
        needed = -(-stop // self.cache.block_size) - len(self.cache.block_table(seq.seq_id))
        return needed + len(self.running) <= self.cache.num_free_blocks

    def _start(self, seq: Request) -> Piece:
        """The next piece of ``seq``, its blocks taken."""
        if seq.preemptions and not self.cache.block_table(seq.seq_id):
            self.prompts.share(seq, len(self.running))  # resuming: its prompt blocks, if cached
        start, target = seq.prefilled, self.target(seq)
        stop = self.piece_stop(start, target)
        self._grow(seq, self.blocks_to(seq, stop, target))
        return Piece(seq, start, stop, stop == target)

    @staticmethod
    def blocks_to(seq: Request, stop: int, target: int) -> int:
        """Positions a piece ending at ``stop`` needs blocks for: the piece's, and where it
        completes ``seq``, its tokens past the target too (fixed before its first
        sample, ``Request.opening``, or waiting when it was preempted): their rows run in
        the same step (``forward.py``)."""
        return max(stop, seq.length + len(seq.opening)) if stop == target else stop

    # -- blocks --------------------------------------------------------------------
    def _make_room(self, seqs: list[Request]) -> list[Request]:
        """Blocks for every position of each running sequence (preempting where the pool
        cannot supply them). Returns the sequences still running."""
        for seq in list(seqs):
            if seq in self.running:
                self._grow(seq, seq.length)
        return [s for s in seqs if s in self.running]

    def _grow(self, seq: Request, tokens: int) -> None:
        """Blocks for ``seq``'s first ``tokens`` positions; while the pool cannot supply
        them, preempt the sequence ``_victim`` names (which may be ``seq`` itself when it
        is running beside others). ``PoolExhausted`` when nobody can give way."""
        while True:
            try:
                self.cache.allocate(seq.seq_id, tokens)
                return
            except PoolExhausted:
                victim = self._victim(seq)
                if victim is None:
                    raise
                self.preempt(victim)
                if victim is seq:
                    return

    def _victim(self, needy: Request) -> Request | None:
        """Whom to preempt so ``needy`` can grow: of the sequences holding blocks (running,
        or waiting part-prefilled), the one holding the most (the newest among equals);
        ``needy`` itself only if it is running beside others. Never one whose
        query-aware reads a recompute cannot replay."""
        holders = [
            s for s in [*self.running, *self.waiting]
            if self.cache.block_table(s.seq_id) and not s.controller.selects_blocks
        ]
        if needy not in self.running or len(self.running) < 2:
            holders = [s for s in holders if s is not needy]
        if not holders:
            return None
        return max(reversed(holders), key=lambda s: len(self.cache.block_table(s.seq_id)))

    def preempt(self, seq: Request) -> None:
        """Give ``seq``'s blocks back and queue it first to resume: its prompt comes back
        from the prefix cache where still cached, the rest is recomputed under the
        views it was decoded with (``forward.recomputed_views``)."""
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.insert(0, seq)
        self.release(seq)
        seq.preemptions += 1
        seq.prefilled = seq.registered = 0

    # -- membership ----------------------------------------------------------------
    def prefilled(self, piece: Piece) -> None:
        """``piece`` ran: address its blocks, and move a completed sequence to running."""
        seq = piece.seq
        seq.prefilled = piece.stop
        self.prompts.register(seq)
        if piece.last and seq in self.waiting:
            self.waiting.remove(seq)
            self.running.append(seq)

    def remove(self, seq: Request) -> None:
        """Take ``seq`` out (finished or aborted) and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)
