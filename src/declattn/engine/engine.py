"""The decode loop: sequences in, one token per running sequence per step out.

Each sequence has a ``Controller`` that the layer above supplies (a DA session, a
vanilla request, a baseline). Before a decode step the engine asks it for the sequence's view;
after sampling it hands it the token and its text. The engine itself never looks at
what the text says, so DA and vanilla run the same code path.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from declattn.engine.blocks import block_digests
from declattn.engine.controller import Controller
from declattn.engine.detok import Detokenizer
from declattn.engine.kv import KVCache, KVConfig, PoolExhausted
from declattn.engine.kvdisk.options import DiskOptions
from declattn.engine.kvdisk.tier import DiskTier
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.models.token_context import TokenContext, token_context
from declattn.engine.paged import PagedAttention, SeqStep
from declattn.engine.reads import ReadCounter
from declattn.engine.request import Request, StepRead, TokenEvent
from declattn.engine.sampler import SamplingParams, sample
from declattn.engine.stops import cut_at_stop

DEFAULT_PREFILL_CHUNK = 512
"""Prompt tokens per prefill step. Attention over the earlier context costs the same
however the prompt is cut, and on CPU the projections run no faster on longer chunks
(bf16 GEMMs measured 150 GFLOP/s at 512 rows, 120 at 2,048; SmolLM2 4K prefills within
noise from 512 to 4,096), while a shorter chunk stalls the other running sequences of
a batch for less time and keeps activations small."""


class PagedEngine:
    """A batch of sequences over one paged KV cache and one model."""

    def __init__(
        self,
        model: Decoder,
        tokenizer: Any,
        *,
        num_blocks: int,
        block_size: int = 16,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        kv_dtype: torch.dtype | None = None,
        prefix_caching: bool = True,
        batch_invariant: bool = False,
        kv_disk: DiskOptions | None = None,
    ) -> None:
        """``prefix_caching``: full prompt blocks are kept addressed by content and later
        prompts that start with the same tokens take them over (see ``blocks.py``);
        ``kv_disk`` adds the cache's disk tier under it (``kvdisk/tier.py``).

        ``batch_invariant``: each running sequence's decode step is its own model call, so
        a sequence's logits never depend on who else is in the batch. Batched matmuls may
        pick a kernel (and so a summation order) by the number of rows; one row at a time
        gives every sequence exactly what it gets alone, for a batch's weight reads
        multiplied by its size. Prefill is one sequence per chunk at fixed chunk
        boundaries either way."""
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if prefix_caching and prefill_chunk % block_size:
            raise ValueError(
                f"prefill_chunk ({prefill_chunk}) must be a multiple of the block size "
                f"({block_size}) for prefix caching"
            )
        c: ModelConfig = model.config
        param = next(model.parameters())
        self.model = model
        self.tokenizer = tokenizer
        self.device = param.device
        self.prefill_chunk = prefill_chunk
        self.batch_invariant = batch_invariant
        self.cache = KVCache(
            KVConfig(
                n_layers=c.num_layers,
                n_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                num_blocks=num_blocks,
                block_size=block_size,
                dtype=kv_dtype or param.dtype,
                device=self.device,
            ),
            prefix_caching=prefix_caching,
        )
        self.disk = (
            DiskTier(kv_disk, self.cache.config, prefill_chunk, tokenizer)
            if kv_disk is not None and prefix_caching else None
        )
        self.counter = ReadCounter()
        self._global_layers = [i for i in range(c.num_layers) if c.window(i) is None]
        self._eos = set(c.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self._eos.add(tokenizer.eos_token_id)
        self._ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # -- requests ------------------------------------------------------------------
    def add(self, controller: Controller, params: SamplingParams) -> Request:
        """Queue a sequence for ``controller.prompt_ids``; it is prefilled by later steps."""
        n = len(controller.prompt_ids)
        if not n:
            raise ValueError("empty prompt")
        limit = self.model.config.max_position_embeddings
        if n + params.max_tokens > limit:
            raise ValueError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} exceeds "
                f"the model's {limit} positions"
            )
        seq = Request(
            seq_id=next(self._ids),
            params=params,
            controller=controller,
            detok=Detokenizer(self.tokenizer),
            generator=params.generator(),
        )
        seq.cached_tokens = self._share_prefix(seq)
        self.waiting.append(seq)
        return seq

    def _share_prefix(self, seq: Request) -> int:
        """Start ``seq`` on the cached blocks of its prompt's longest cached prefix.

        The shared part stops at a multiple of the prefill chunk below the prompt's last
        token: the rest is then prefilled in exactly the chunks a fresh prefill would
        use, so a cached prefix gives bit-identical results (and the last token's logits
        are always computed, never taken from a cache).
        """
        if not self.cache.blocks.caching:
            return 0
        n, bs = len(seq.prompt_ids), self.block_size
        config = self.model.config
        regions = seq.controller.regions(0, n) if config.needs_token_context else None
        seq.digests = block_digests(seq.prompt_ids, regions, bs)
        usable = seq.digests[: (n - 1) // bs]  # the last prompt token is always computed
        shared = self.cache.share_prefix(seq.seq_id, usable, self.prefill_chunk // bs)
        if self.disk is not None:  # the disk tier goes on in whole chunks where memory ends
            room = self.cache.num_free_blocks - len(self.running)
            shared += self.disk.restore(self.cache, seq, usable, shared, room)
        seq.prefilled = seq.registered = shared * bs
        return shared * bs

    def _register(self, seq: Request, start: int) -> None:
        """Address the prompt blocks the last prefill chunk (from ``start``) completed, and
        hand the chunk to the disk tier."""
        full = min(seq.prefilled // self.block_size, len(seq.digests))
        for index in range(seq.registered // self.block_size, full):
            self.cache.register(seq.seq_id, index, seq.digests[index])
        seq.registered = max(seq.registered, full * self.block_size)
        if self.disk is not None:
            self.disk.save(self.cache, seq, start, seq.prefilled)

    def prefill_synthetic(
        self, seq: Request, upto: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Fill the K/V of ``seq``'s first ``upto`` prompt positions (all but the last by
        default) with random values and count them as prefilled.

        For benchmarks of decode: what a decode step costs does not depend on the values
        it reads, and a real prefill of 128K tokens takes hours on a CPU. The rest of the
        prompt is prefilled for real by the next ``step``, so the first token still comes
        out of the model. Only a waiting sequence with nothing prefilled qualifies.
        """
        if seq not in self.waiting or seq.prefilled:
            raise ValueError("prefill_synthetic needs a waiting sequence with nothing prefilled")
        seq.digests = []  # noise must never be cached as the prompt's K/V
        n = len(seq.prompt_ids) - 1 if upto is None else upto
        if not 0 <= n < len(seq.prompt_ids):
            raise ValueError(f"upto must be in [0, {len(seq.prompt_ids)}), got {n}")
        self.cache.allocate(seq.seq_id, n)
        slots = self.cache.slots(seq.seq_id, 0, n)
        for pools in (self.cache.k, self.cache.v):
            for pool in pools:
                noise = torch.empty(pool.shape[0], n, pool.shape[2], dtype=pool.dtype)
                pool[:, slots] = noise.normal_(generator=generator).to(pool.device)
        seq.prefilled = n

    def abort(self, seq: Request, reason: str = "abort") -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = seq.finish_reason or reason
        self._free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- stepping ------------------------------------------------------------------
    def next_batch(self) -> list[Request]:
        """What the next ``step`` works on: the first waiting sequence (one prefill
        chunk) if its chunk has room, else every running one (one decode step)."""
        if self.waiting and (self._chunk_fits(self.waiting[0]) or not self.running):
            return self.waiting[:1]
        return list(self.running)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Run one prefill chunk (if a sequence waits and its chunk has room) or one
        decode step for all running sequences.

        Blocks are taken as sequences grow. A waiting sequence whose next chunk the pool
        cannot hold waits while the running ones decode (and finish, freeing blocks);
        a decode step the pool cannot hold preempts the running sequence holding the
        most blocks, which later resumes by recompute (see ``_preempt``)."""
        if self.waiting and (self._chunk_fits(self.waiting[0]) or not self.running):
            return self._prefill_chunk(self.waiting[0])
        if self.running:
            try:
                return self._decode(list(self.running))
            finally:
                self.counter.reset()  # a failed step leaves no records behind
        return []

    def _prefill_target(self, seq: Request) -> int:
        """Positions to fill before ``seq`` decodes: its prompt, or, for a preempted
        sequence, everything but its newest token (the next decode step's input)."""
        return seq.length - 1 if seq.output_ids else len(seq.prompt_ids)

    def _chunk_fits(self, seq: Request) -> bool:
        """Whether ``seq``'s next prefill chunk has room, keeping one block per running
        sequence free so that starting it does not at once preempt another. A preempted
        sequence resumes only when all it must recompute fits, plus its next token:
        resuming part way would only get it preempted again."""
        target = self._prefill_target(seq)
        stop = target + 1 if seq.preemptions else min(target, seq.prefilled + self.prefill_chunk)
        needed = -(-stop // self.block_size) - len(self.cache.block_table(seq.seq_id))
        return needed + len(self.running) <= self.cache.num_free_blocks

    def _prefill_chunk(self, seq: Request) -> list[TokenEvent]:
        t0 = time.perf_counter()
        if seq.preemptions and not self.cache.block_table(seq.seq_id):
            self._share_prefix(seq)  # resuming: the prompt's blocks, if still cached
        start, target = seq.prefilled, self._prefill_target(seq)
        stop = min(target, start + self.prefill_chunk)
        self._grow(seq, stop)
        ids = torch.tensor(seq.token_ids[start:stop], device=self.device)
        pos = torch.arange(start, stop, device=self.device)
        step = SeqStep(seq.seq_id, start, stop - start, row_views=self._recomputed_views(
            seq, start, stop))
        attn = PagedAttention(self.cache, [step])
        hidden = self.model(ids, pos, attn, self._context([(seq, range(start, stop))]))
        seq.prefilled = stop
        self._register(seq, start)
        seq.prefill_seconds += time.perf_counter() - t0
        if stop < target:
            return []
        self.waiting.remove(seq)
        self.running.append(seq)
        if seq.output_ids:  # a resumed sequence: its next token is already sampled
            return []
        t1 = time.perf_counter()
        event = self._accept(seq, self.model.logits(hidden[-1:])[0])
        seq.prefill_seconds += time.perf_counter() - t1
        return [event]

    def _recomputed_views(
        self, seq: Request, start: int, stop: int
    ) -> tuple[tuple[int, ...] | None, ...] | None:
        """Each recomputed output position's view: the blocks its decode step read
        (``None`` where it read them all), so recompute reproduces the DA K/V."""
        n = len(seq.prompt_ids)
        if stop <= n:
            return None
        views: list[tuple[int, ...] | None] = [None] * max(0, n - start)
        for p in range(max(start, n), stop):
            read = seq.reads[p - n]
            full = not read.blocks or len(read.blocks) == -(-read.length // self.block_size)
            views.append(None if full else read.blocks)
        return tuple(views)

    def _make_room(self, seqs: list[Request]) -> list[Request]:
        """Blocks for every running sequence's next position (preempting where the pool
        cannot supply them). Returns the sequences still running."""
        for seq in list(seqs):
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
                self._preempt(victim)
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

    def _preempt(self, seq: Request) -> None:
        """Give ``seq``'s blocks back and queue it first to resume: its prompt comes back
        from the prefix cache where still cached, the rest is recomputed under the
        views it was decoded with (``_recomputed_views``)."""
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.insert(0, seq)
        self._free(seq)
        seq.preemptions += 1
        seq.prefilled = seq.registered = 0

    def _decode(self, seqs: list[Request]) -> list[TokenEvent]:
        seqs = self._make_room(seqs)
        if not self.batch_invariant:
            return self._decode_rows(seqs) if seqs else []
        return [event for seq in seqs for event in self._decode_rows([seq])]

    def _decode_rows(self, seqs: list[Request]) -> list[TokenEvent]:
        """One model call decoding one token for each of ``seqs`` (blocks already made)."""
        t0 = time.perf_counter()
        steps = []
        for seq in seqs:
            length = seq.length  # positions read: all stored + the new token's own
            ctl = seq.controller
            select = ctl.select_blocks if ctl.selects_blocks else None
            steps.append(SeqStep(seq.seq_id, length - 1, 1, ctl.view(length), select))
        ids = torch.tensor([s.output_ids[-1] for s in seqs], device=self.device)
        pos = torch.tensor([s.length - 1 for s in seqs], device=self.device)
        attn = PagedAttention(
            self.cache, steps, self.counter, placement_invariant=self.batch_invariant
        )
        context = self._context([(s, range(s.length - 1, s.length)) for s in seqs])
        hidden = self.model(ids, pos, attn, context)
        logits = self.model.logits(hidden)
        elapsed = time.perf_counter() - t0
        events = []
        for row, (seq, st) in enumerate(zip(seqs, steps, strict=True)):
            seq.reads.append(self._harvest(attn.step, seq, st, elapsed))
            seq.decode_seconds += elapsed
            events.append(self._accept(seq, logits[row]))
        return events

    def _context(self, rows: list[tuple[Request, range]]) -> TokenContext | None:
        """Neighbours and chunk ids of the step's tokens, for models that need them."""
        config = self.model.config
        if not config.needs_token_context:
            return None
        parts = []
        for seq, positions in rows:
            lo = max(0, positions.start - config.token_shift)
            regions = seq.controller.regions(lo, positions.stop)
            ids = seq.token_ids[lo : positions.stop]
            shift = config.token_shift
            parts.append(token_context(ids, regions, positions, shift, lo, self.device))
        return TokenContext.cat(parts)

    def _harvest(self, step: int, seq: Request, st: SeqStep, elapsed: float) -> StepRead:
        per_layer = [
            self.counter.blocks_read(step, seq.seq_id, layer) or () for layer in self._global_layers
        ]
        return StepRead(
            index=len(seq.output_ids),
            length=st.length,
            blocks=per_layer[0] if per_layer else (),
            layers_agree=all(b is per_layer[0] or b == per_layer[0] for b in per_layer),
            global_bytes=self.counter.total_bytes(seq_id=seq.seq_id, step=step),
            sliding_bytes=self.counter.total_bytes(sliding=True, seq_id=seq.seq_id, step=step),
            seconds=elapsed,
        )

    def _accept(self, seq: Request, logits: Tensor) -> TokenEvent:
        logits = seq.controller.process_logits(logits)
        token = sample(logits, seq.params, seq.generator)
        seq.output_ids.append(token)
        text = seq.detok.add(token)
        reason = None
        if token in self._eos and not seq.params.ignore_eos:
            reason = "eos"
            text += seq.detok.flush()
        text, seq.held, stopped = cut_at_stop(seq.held, text, seq.params.stop, reason is None)
        reason = "stop" if stopped else reason
        if reason is None and len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is not None and reason != "stop":
            text += seq.held  # a finished response releases what it held back
            seq.held = ""
        seq.token_texts.append(text)
        reason = seq.controller.on_token(token, text) or reason
        if reason is not None:
            self._finish(seq, reason)
        return TokenEvent(seq.seq_id, token, text, len(seq.output_ids) - 1, reason)

    def _free(self, seq: Request) -> None:
        self.cache.free(seq.seq_id)

    def _finish(self, seq: Request, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)

    # -- convenience ---------------------------------------------------------------
    def run(self, seq: Request) -> Iterator[TokenEvent]:
        """Step until ``seq`` finishes, yielding its events (other sequences advance too)."""
        while seq.finish_reason is None:
            for event in self.step():
                if event.seq_id == seq.seq_id:
                    yield event
