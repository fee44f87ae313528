"""The decode loop: sequences in, one token per running sequence per step out.

Each sequence has a controller that the layer above supplies (the DA session, or
nothing for vanilla). Before a decode step the engine asks it for the sequence's view;
after sampling it hands it the token and its text. The engine itself never looks at
what the text says, so DA and vanilla run the same code path.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from declattn.engine.attention import (
    DEFAULT_PREFILL_STRATEGY,
    PagedAttention,
    ReadCounter,
    SeqStep,
)
from declattn.engine.detok import Detokenizer
from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.models.token_context import TokenContext, token_context
from declattn.engine.sampler import SamplingParams, sample
from declattn.protocol.layout import RESPONSE, SCAFFOLD


class Controller(Protocol):
    """What the layer above decides for one sequence; all three hooks are optional."""

    def view(self, length: int) -> Sequence[int] | None:
        """Logical blocks the next decode step (reading ``length`` positions) may read."""
        ...

    def process_logits(self, logits: Tensor) -> Tensor: ...

    def on_token(self, token_id: int, text: str) -> str | None:
        """Called after each sampled token; a returned string finishes the sequence."""
        ...

    # Optional, query-aware: ``select_blocks(layer, q) -> blocks`` picks each global
    # layer's blocks from that layer's query (see ``SeqStep.select``); it overrides the
    # view on global layers. Not declared here so that ``view`` alone still satisfies
    # the protocol.


@dataclass(frozen=True)
class StepRead:
    """What one decode step of one sequence actually read from the KV pools."""

    index: int
    length: int
    blocks: tuple[int, ...]
    layers_agree: bool
    global_bytes: int
    sliding_bytes: int
    seconds: float


@dataclass
class Sequence_:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    controller: Any
    detok: Detokenizer
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    reads: list[StepRead] = field(default_factory=list)
    held: str = ""
    prefilled: int = 0
    finish_reason: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.token_texts)


@dataclass(frozen=True)
class TokenEvent:
    seq_id: int
    token_id: int
    text: str
    index: int
    finish_reason: str | None


DEFAULT_PREFILL_CHUNK = 512
"""Prompt tokens per prefill step. Attention over the earlier context costs the same
however the prompt is cut, and on CPU the projections run no faster on longer chunks
(bf16 GEMMs measured 150 GFLOP/s at 512 rows, 120 at 2,048; SmolLM2 4K prefills within
noise from 512 to 4,096), while a shorter chunk stalls the other running sequences of
a batch for less time and keeps activations small."""


def _hook(controller: Any, name: str) -> Callable | None:
    return getattr(controller, name, None) if controller is not None else None


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
        prefill_strategy: str = DEFAULT_PREFILL_STRATEGY,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        c: ModelConfig = model.config
        param = next(model.parameters())
        self.model = model
        self.tokenizer = tokenizer
        self.device = param.device
        self.prefill_chunk = prefill_chunk
        self.prefill_strategy = prefill_strategy
        self.cache = KVCache(
            KVConfig(
                n_layers=c.num_layers,
                n_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                num_blocks=num_blocks,
                block_size=block_size,
                dtype=kv_dtype or param.dtype,
                device=self.device,
            )
        )
        self.counter = ReadCounter()
        self._global_layers = [i for i in range(c.num_layers) if c.window(i) is None]
        self._eos = set(c.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self._eos.add(tokenizer.eos_token_id)
        self._ids = itertools.count()
        self.waiting: list[Sequence_] = []
        self.running: list[Sequence_] = []

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # -- requests ------------------------------------------------------------------
    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, controller: Any = None
    ) -> Sequence_:
        if not prompt_ids:
            raise ValueError("empty prompt")
        limit = self.model.config.max_position_embeddings
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds "
                f"the model's {limit} positions"
            )
        seq = Sequence_(
            seq_id=next(self._ids),
            prompt_ids=list(prompt_ids),
            params=params,
            controller=controller,
            detok=Detokenizer(self.tokenizer),
            generator=params.generator(),
        )
        self.waiting.append(seq)
        return seq

    def prefill_synthetic(
        self, seq: Sequence_, upto: int | None = None, generator: torch.Generator | None = None
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

    def abort(self, seq: Sequence_, reason: str = "abort") -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = seq.finish_reason or reason
        self.cache.free(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- stepping ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Run one prefill chunk (if a sequence waits) or one decode step for all."""
        if self.waiting:
            return self._prefill_chunk(self.waiting[0])
        if self.running:
            return self._decode(list(self.running))
        return []

    def _prefill_chunk(self, seq: Sequence_) -> list[TokenEvent]:
        t0 = time.perf_counter()
        start = seq.prefilled
        stop = min(len(seq.prompt_ids), start + self.prefill_chunk)
        self.cache.allocate(seq.seq_id, stop)
        ids = torch.tensor(seq.prompt_ids[start:stop], device=self.device)
        pos = torch.arange(start, stop, device=self.device)
        attn = PagedAttention(
            self.cache,
            [SeqStep(seq.seq_id, start, stop - start)],
            None,
            prefill_strategy=self.prefill_strategy,
        )
        hidden = self.model(ids, pos, attn, self._context([(seq, range(start, stop))]))
        seq.prefilled = stop
        if stop < len(seq.prompt_ids):
            seq.prefill_seconds += time.perf_counter() - t0
            return []
        logits = self.model.logits(hidden[-1:])[0]
        self.waiting.remove(seq)
        self.running.append(seq)
        event = self._accept(seq, logits)
        seq.prefill_seconds += time.perf_counter() - t0
        return [event]

    def _decode(self, seqs: list[Sequence_]) -> list[TokenEvent]:
        t0 = time.perf_counter()
        steps = []
        for seq in seqs:
            length = seq.length  # positions read: all stored + the new token's own
            self.cache.allocate(seq.seq_id, length)
            view_fn = _hook(seq.controller, "view")
            view = view_fn(length) if view_fn else None
            select = _hook(seq.controller, "select_blocks")
            steps.append(SeqStep(seq.seq_id, length - 1, 1, view, select))
        ids = torch.tensor([s.output_ids[-1] for s in seqs], device=self.device)
        pos = torch.tensor([s.length - 1 for s in seqs], device=self.device)
        attn = PagedAttention(self.cache, steps, self.counter)
        context = self._context([(s, range(s.length - 1, s.length)) for s in seqs])
        hidden = self.model(ids, pos, attn, context)
        logits = self.model.logits(hidden)
        elapsed = time.perf_counter() - t0
        events = []
        for row, (seq, st) in enumerate(zip(seqs, steps, strict=True)):
            seq.reads.append(self._harvest(attn.step, seq, st, elapsed))
            seq.decode_seconds += elapsed
            events.append(self._accept(seq, logits[row]))
        self.counter.reset()
        return events

    def _context(self, rows: list[tuple[Sequence_, range]]) -> TokenContext | None:
        """Neighbours and chunk ids of the step's tokens, for models that need them."""
        config = self.model.config
        if not config.needs_token_context:
            return None
        parts = []
        for seq, positions in rows:
            lo = max(0, positions.start - config.token_shift)
            layout = getattr(seq.controller, "layout", None)
            if layout is not None:
                regions = layout.regions(lo, positions.stop)
            else:  # a plain prompt: one region, then the response
                n = len(seq.prompt_ids)
                regions = [SCAFFOLD if p < n else RESPONSE for p in range(lo, positions.stop)]
            ids = [*seq.prompt_ids, *seq.output_ids][lo : positions.stop]
            shift = config.token_shift
            parts.append(token_context(ids, regions, positions, shift, lo, self.device))
        return TokenContext.cat(parts)

    def _harvest(self, step: int, seq: Sequence_, st: SeqStep, elapsed: float) -> StepRead:
        per_layer = [
            self.counter.blocks_read(step, seq.seq_id, layer) or () for layer in self._global_layers
        ]
        return StepRead(
            index=len(seq.output_ids),
            length=st.length,
            blocks=per_layer[0] if per_layer else (),
            layers_agree=all(b == per_layer[0] for b in per_layer),
            global_bytes=self.counter.total_bytes(seq_id=seq.seq_id, step=step),
            sliding_bytes=self.counter.total_bytes(sliding=True, seq_id=seq.seq_id, step=step),
            seconds=elapsed,
        )

    def _accept(self, seq: Sequence_, logits: Tensor) -> TokenEvent:
        process = _hook(seq.controller, "process_logits")
        if process is not None:
            logits = process(logits)
        token = sample(logits, seq.params, seq.generator)
        seq.output_ids.append(token)
        text = seq.detok.add(token)
        reason = None
        if token in self._eos and not seq.params.ignore_eos:
            reason = "eos"
            text += seq.detok.flush()
        text, reason = self._stop_strings(seq, text, reason)
        if reason is None and len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is not None and reason != "stop":
            text += seq.held  # a finished response releases what it held back
            seq.held = ""
        seq.token_texts.append(text)
        on_token = _hook(seq.controller, "on_token")
        if on_token is not None:
            reason = on_token(token, text) or reason
        if reason is not None:
            self._finish(seq, reason)
        return TokenEvent(seq.seq_id, token, text, len(seq.output_ids) - 1, reason)

    @staticmethod
    def _stop_strings(seq: Sequence_, text: str, reason: str | None) -> tuple[str, str | None]:
        """Cut the output at a stop string; hold back a tail that may begin one.

        The held text is released with the next token (or at the end), so a stop string
        split over tokens is never half-shown.
        """
        stops = seq.params.stop
        if not stops:
            return text, reason
        pending = seq.held + text
        seq.held = ""
        for stop in stops:
            at = pending.find(stop)
            if at >= 0:
                return pending[:at], "stop"
        if reason is None:
            keep = len(pending)
            for stop in stops:
                for n in range(min(len(stop) - 1, len(pending)), 0, -1):
                    if pending.endswith(stop[:n]):
                        keep = min(keep, len(pending) - n)
                        break
            seq.held = pending[keep:]
            pending = pending[:keep]
        return pending, reason

    def _finish(self, seq: Sequence_, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self.cache.free(seq.seq_id)

    # -- convenience ---------------------------------------------------------------
    def run(self, seq: Sequence_) -> Iterator[TokenEvent]:
        """Step until ``seq`` finishes, yielding its events (other sequences advance too)."""
        while seq.finish_reason is None:
            for event in self.step():
                if event.seq_id == seq.seq_id:
                    yield event
