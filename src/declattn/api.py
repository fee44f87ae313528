"""The public entry point: ``Engine.from_pretrained(...)`` then ``answer`` or ``generate``.

This facade sits above the session layer: it builds a session per request (DA,
DA-nm or vanilla), drives the paged engine with it, and gathers the result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from declattn.constrain import VocabCache
from declattn.engine.engine import DEFAULT_PREFILL_CHUNK, PagedEngine, Sequence_, StepRead
from declattn.engine.loader import LoadedModel, load_model
from declattn.engine.registry import resolve_model
from declattn.engine.sampler import SamplingParams
from declattn.protocol.tags import Declaration
from declattn.session import DAOptions, DASession, PlainSession, model_da_defaults

DEFAULT_KV_TOKENS = 160 * 1024
CONSTRAIN_BELOW_PARAMS = 1_000_000_000
"""``DAOptions(constrain=None)`` turns the focus constraint on for models smaller than this:
they are the ones that write malformed declarations."""


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output: text safe to show, and the mode it was written in."""

    text: str
    mode: str
    focus_ids: tuple[int, ...]
    token_index: int
    finish_reason: str | None = None


@dataclass
class Stats:
    """Counts for one response. Attended figures are sums over decode steps."""

    prompt_tokens: int
    output_tokens: int
    decode_steps: int
    prefill_seconds: float
    decode_seconds: float
    logical_attended: int
    physical_attended: int
    vanilla_attended: int
    vanilla_physical: int
    blocks_read: int
    bytes_read: int
    by_mode: dict[str, dict[str, int]]

    @property
    def saving(self) -> float:
        """Fraction of vanilla's logical reads avoided."""
        return 1.0 - self.logical_attended / self.vanilla_attended if self.vanilla_attended else 0.0

    @property
    def physical_saving(self) -> float:
        v = self.vanilla_physical
        return 1.0 - self.physical_attended / v if v else 0.0


@dataclass
class Answer:
    text: str
    answer: str | None
    arm: str
    finish_reason: str | None
    declarations: list[Declaration]
    declines: list[Declaration]
    stats: Stats
    token_texts: list[str]
    session: Any = field(repr=False)
    reads: list[StepRead] = field(repr=False, default_factory=list)


class Engine:
    """A loaded model with a paged KV cache, answering DA and vanilla requests."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_tokens: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """``kv_tokens`` sizes the KV pool shared by all sequences in flight; by default
        ``DEFAULT_KV_TOKENS``, or one sequence of the model's whole context if that is
        less (a batch of many sequences asks for more explicitly)."""
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source}: the model has no tokenizer")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens must be at least 1, got {kv_tokens}")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if kv_tokens is None:
            limit = loaded.config.max_position_embeddings
            kv_tokens = min(DEFAULT_KV_TOKENS, limit + block_size)
        num_blocks = -(-kv_tokens // block_size)
        self.core = PagedEngine(
            loaded.model,
            loaded.tokenizer,
            num_blocks=num_blocks,
            block_size=block_size,
            prefill_chunk=prefill_chunk,
        )
        self.n_params = sum(p.numel() for p in loaded.model.parameters())
        self.da_defaults = model_da_defaults(loaded.weights_dir)
        self.focus_vocabs = VocabCache()

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a shipped model by name, a GGUF file or a Hugging Face directory."""
        if isinstance(dtype, str):
            dtype = {
                "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16,
                "fp32": torch.float32,
                "float32": torch.float32,
                "fp16": torch.float16,
            }[dtype]
        return cls(load_model(resolve_model(path_or_name), dtype=dtype, device=device), **kwargs)

    @property
    def block_size(self) -> int:
        return self.core.block_size

    # -- requests ------------------------------------------------------------------
    def session(
        self,
        context: str,
        question: str,
        *,
        da: bool = True,
        options: DAOptions | None = None,
        max_tokens: int | None = None,
    ) -> DASession | PlainSession:
        """The session for one request: DA (masking on or off) or vanilla.

        ``max_tokens`` is the response's budget, which the runaway guard needs to tell
        when an answer can no longer fit.
        """
        if not question.strip():
            raise ValueError("the question is empty")
        if da:
            options = options or self.da_defaults
            if options.constrain is None:
                small = self.n_params < CONSTRAIN_BELOW_PARAMS
                options = dataclasses.replace(options, constrain=small)
            vocab = self.focus_vocabs.get(self.tokenizer) if options.constrain else None
            return DASession(
                self.tokenizer,
                context,
                question,
                options,
                self.block_size,
                max_tokens=max_tokens,
                focus_vocab=vocab,
            )
        if not context.strip():
            raise ValueError("the context is empty")
        return PlainSession(self.tokenizer, context, question, self.block_size)

    def generate(
        self,
        context: str,
        question: str,
        *,
        da: bool = True,
        options: DAOptions | None = None,
        params: SamplingParams | None = None,
        max_tokens: int = 512,
        on_prefill: Callable[[int, int], None] | None = None,
        result: list[Answer] | None = None,
    ) -> Iterator[Delta]:
        """Stream a response as text deltas, holding back partial tags.

        ``on_prefill(done, total)`` reports prefill progress. When the stream ends, the
        finished ``Answer`` is appended to ``result`` if one is given.
        """
        params = params or SamplingParams(max_tokens=max_tokens)
        sess = self.session(context, question, da=da, options=options, max_tokens=params.max_tokens)
        seq = self.core.add(sess.prompt_ids, params, sess)
        t0 = time.perf_counter()
        while seq.finish_reason is None and seq in self.core.waiting:
            self.core.step()
            if on_prefill is not None:
                on_prefill(seq.prefilled, len(seq.prompt_ids))
        yield from self._stream(sess, seq, t0, result)

    def _stream(
        self, sess: Any, seq: Sequence_, t0: float, result: list[Answer] | None
    ) -> Iterator[Delta]:
        reader = getattr(sess, "reader", None)
        shown = 0
        index = 0  # the first token came from the prefill step
        while True:
            finished = seq.finish_reason is not None
            if reader is not None:
                if finished:
                    reader.finish()
                text = sess.text[shown : reader.safe_end]
                mode, ids = str(reader.mode), reader.focus_ids
            else:
                text, mode, ids = sess.text[shown:], "vanilla", ()
            shown += len(text)
            if text or finished:
                yield Delta(text, mode, ids, index, seq.finish_reason)
            if finished:
                break
            self.core.step()
            index = len(seq.output_ids) - 1
        if result is not None:
            result.append(self._answer(sess, seq, time.perf_counter() - t0))

    def answer(
        self,
        context: str,
        question: str,
        *,
        da: bool = True,
        max_tokens: int = 512,
        options: DAOptions | None = None,
        params: SamplingParams | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Answer:
        """Answer ``question`` over ``context``; ``da=False`` is the vanilla arm."""
        out: list[Answer] = []
        for _ in self.generate(
            context,
            question,
            da=da,
            options=options,
            params=params,
            max_tokens=max_tokens,
            on_prefill=on_prefill,
            result=out,
        ):
            pass
        return out[0]

    def _answer(self, sess: Any, seq: Sequence_, wall: float) -> Answer:
        acc = sess.accounting
        totals = acc.totals()
        is_da = isinstance(sess, DASession)
        stats = Stats(
            prompt_tokens=len(seq.prompt_ids),
            output_tokens=len(seq.output_ids),
            decode_steps=acc.steps,
            prefill_seconds=seq.prefill_seconds,
            decode_seconds=seq.decode_seconds,
            logical_attended=totals["logical"],
            physical_attended=totals["physical"],
            vanilla_attended=totals["vanilla_logical"],
            vanilla_physical=totals["vanilla_physical"],
            blocks_read=sum(len(r.blocks) for r in seq.reads),
            bytes_read=sum(r.global_bytes + r.sliding_bytes for r in seq.reads),
            by_mode={str(m): v for m, v in acc.by_mode().items()},
        )
        return Answer(
            text=sess.text,
            answer=sess.answer,
            arm=sess.mode_name,
            finish_reason=seq.finish_reason,
            declarations=list(sess.declarations) if is_da else [],
            declines=list(sess.declines) if is_da else [],
            stats=stats,
            token_texts=list(seq.token_texts),
            session=sess,
            reads=list(seq.reads),
        )
