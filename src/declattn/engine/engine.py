"""The engine: sequences in, their tokens out, one forward per step.

Each sequence has a ``Controller`` that the layer above supplies (a DA session, a
vanilla request, a baseline). Before a decode row the engine asks it for the row's view;
after a token is accepted it hands it the token and its text. The engine itself never
looks at what the text says, so DA and vanilla run the same code path.

A step is planned by the ``Scheduler`` (which rows: every running sequence's decode rows
and a piece of a waiting prompt), computed by ``Forward`` (one model call) and finished
by the ``Acceptor`` (sampling, text, stop rules, forced tokens).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch

from declattn.engine.accept import Acceptor
from declattn.engine.controller import Controller
from declattn.engine.detok import Detokenizer
from declattn.engine.forward import Forward
from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.kvdisk.options import DiskOptions
from declattn.engine.kvdisk.tier import DiskTier
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.prefix import PromptCache
from declattn.engine.quant.linear import hold_dense
from declattn.engine.reads import ReadCounter
from declattn.engine.request import Request, TokenEvent
from declattn.engine.row_cost import RowCost
from declattn.engine.sampler import SamplingParams
from declattn.engine.scheduler import Scheduler

DEFAULT_PREFILL_BUDGET = 128
"""Prompt tokens one step computes beside the decode rows (``prefill_budget``): the
streams' wait between two tokens against the new prompt's time to its first. While
prompts prefill, a packed GGUF layer keeps its dequantised weight from one step to the
next (``quant.linear.hold_dense``), so a step's prompt rows cost in proportion to their
number, plus their attention over the prompt so far, which ``row_cost.py`` evens out.
128: measured beside four streams at 16K, it keeps their longest wait under a second
where 256 does not, and a prompt alone prefills a little slower (docs/benchmarks.md,
"The prefill budget")."""

DEFAULT_PREFILL_CHUNK = 512
"""The grid of prompt positions: a piece of a prompt never crosses a multiple of it, and
a cached prefix is shared in whole chunks (``prefix.py``). Attention over the earlier
context costs the same however the prompt is cut, and on CPU the projections run no
faster on longer calls, while a longer call keeps more activations."""


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
        prefill_budget: int | None = None,
        prefill_first: bool = False,
        kv_dtype: torch.dtype | None = None,
        prefix_caching: bool = True,
        batch_invariant: bool = False,
        forcing: bool = True,
        kv_disk: DiskOptions | None = None,
    ) -> None:
        """``prefix_caching``: full prompt blocks are kept addressed by content and later
        prompts that start with the same tokens take them over (see ``prefix.py``);
        ``kv_disk`` adds the cache's disk tier under it (``kvdisk/tier.py``).

        ``prefill_budget``: the most prompt tokens one step computes beside the running
        sequences' decode rows (``DEFAULT_PREFILL_BUDGET``; at most the chunk): the
        trade between the streams' time between tokens and a new prompt's time to its
        first. ``prefill_first`` runs a prompt's pieces alone, before any decode row
        (the scheduling before mixed steps, kept for comparison: ``scheduler.py``).

        ``batch_invariant``: each sequence's rows of a step are their own model call, so
        a sequence's logits never depend on who else is in the batch (``forward.py``).

        ``forcing`` False never asks controllers for forced tokens (``Controller.forced``):
        every token is sampled, one decode step each."""
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
                device=param.device,
            ),
            prefix_caching=prefix_caching,
        )
        self.counter = ReadCounter()
        budget = min(prefill_chunk, prefill_budget or DEFAULT_PREFILL_BUDGET)
        self.disk = (
            DiskTier(kv_disk, self.cache.config, prefill_chunk, budget, tokenizer)
            if kv_disk is not None and prefix_caching else None
        )
        self.prompts = PromptCache(self.cache, c, prefill_chunk, self.disk)
        self.scheduler = Scheduler(
            self.cache, self.prompts, self._free, prefill_chunk=prefill_chunk,
            prefill_budget=budget, prefill_first=prefill_first, row_cost=RowCost.of(c),
        )
        self.forward = Forward(model, self.cache, self.counter, batch_invariant=batch_invariant)
        eos = set(c.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.acceptor = Acceptor(tokenizer, eos, forcing=forcing)
        self._ids = itertools.count()
        self._dtype = param.dtype
        self._holding = False
        self.dense_bytes = 0
        """Bytes of dequantised weights the GGUF layers may keep while prompts prefill
        (``quant.linear.hold_dense``); 0 while none does, or where memory refused it."""

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def prefill_budget(self) -> int:
        return self.scheduler.prefill_budget

    @property
    def waiting(self) -> list[Request]:
        """Sequences waiting for (the rest of) their prefill, the next first."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Sequences decoding."""
        return self.scheduler.running

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
        seq.opening = self.acceptor.opening(seq)
        seq.cached_tokens = self.prompts.share(seq, len(self.running))
        self.waiting.append(seq)
        return seq

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
        seq.finish_reason = seq.finish_reason or reason
        self.scheduler.remove(seq)
        if not self.scheduler.waiting:
            self._hold_dense(False)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- stepping ------------------------------------------------------------------
    def next_batch(self) -> list[Request]:
        """What the next ``step`` works on: the running sequences, and the first waiting
        one when a piece of it goes along (``Scheduler.next_requests``)."""
        return self.scheduler.next_requests()

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One forward: every running sequence's decode rows and a piece of the first
        waiting prompt where it has room (``scheduler.py``); the tokens it gives.

        Blocks are taken as sequences grow; where the pool cannot hold a step's decode
        rows, the sequence holding the most blocks is preempted and later resumes by
        recompute. ``PoolExhausted`` when a lone sequence cannot fit."""
        plan = self.scheduler.schedule()
        if plan.prefill is None and not plan.decode:
            return []
        events: list[TokenEvent] = []
        if plan.prefill is not None:
            self._hold_dense(True)
            if plan.prefill.last and plan.prefill.seq.opening:
                events += self.acceptor.accept_opening(plan.prefill.seq)  # rows run now
        try:
            rows = self.forward.run(plan)
        finally:
            self.counter.reset()  # a failed step leaves no records behind
        for r in rows:
            seq = r.seq
            spent = 0.0 if r.with_prefill else r.seconds  # that forward is the prompt's
            completed = False
            if not r.decode:
                assert plan.prefill is not None
                self.scheduler.prefilled(plan.prefill)
                completed = plan.prefill.last
            if r.logits is not None:
                t0 = time.perf_counter()
                events += self.acceptor.sampled(seq, r.logits)
                spent += time.perf_counter() - t0  # the controller's time is the reply's too
            if r.decode:
                seq.decode_seconds += spent
            else:
                seq.prefill_seconds += spent
            if (r.logits is not None or completed) and seq.finish_reason is not None:
                self.scheduler.remove(seq)
        if not self.scheduler.waiting:
            self._hold_dense(False)
        return events

    def _hold_dense(self, on: bool) -> None:
        """Keep the GGUF layers' dense weights from one step to the next while prompts
        prefill; drop them once no prompt waits (``quant.linear.hold_dense``)."""
        if on != self._holding:
            self._holding = on
            self.dense_bytes = hold_dense(self.model, on, self._dtype)

    def _free(self, seq: Request) -> None:
        self.cache.free(seq.seq_id)

    # -- convenience ---------------------------------------------------------------
    def run(self, seq: Request) -> Iterator[TokenEvent]:
        """Step until ``seq`` finishes, yielding its events (other sequences advance too)."""
        while seq.finish_reason is None:
            for event in self.step():
                if event.seq_id == seq.seq_id:
                    yield event
