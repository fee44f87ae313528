"""The public entry point: ``Engine.from_pretrained(...)`` then ``answer`` or ``generate``.

This facade is the one way in to the engine for everything above it (CLI, server,
eval, train, bench). It offers two levels:

- requests: ``session`` builds the controller of one request (DA, DA-nm or vanilla),
  ``generate``/``answer`` drive it and gather the result;
- batches: ``add``/``step``/``abort``/``run`` over the engine's own KV pool, for callers
  that schedule many controllers themselves (the server, the eval harness, training's
  held-out evaluation). ``with_pool`` gives the same loaded model another pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from declattn.api.document import Document
from declattn.api.results import Answer, Delta, Stats
from declattn.api.session import DASession, PlainSession, Session
from declattn.da.constrain import FocusVocab, VocabCache
from declattn.da.constrain_find import FindVocab
from declattn.da.constrain_open import OpeningVocab
from declattn.da.gate import CLASSIC_SHAPE, ECONOMY_SHAPE, ReplyCost, expected_cost
from declattn.da.options import DAOptions, model_da_defaults
from declattn.engine.controller import Controller
from declattn.engine.engine import DEFAULT_PREFILL_CHUNK, PagedEngine
from declattn.engine.kv import PoolStats, SequenceKeys
from declattn.engine.kvdisk.options import DiskOptions, disk_options, parse_size
from declattn.engine.loader import LoadedModel, load_model
from declattn.engine.models.decoder import DecodeRoute
from declattn.engine.paths import kv_cache_root
from declattn.engine.registry import resolve_model
from declattn.engine.request import Request, TokenEvent
from declattn.engine.sampler import SamplingParams
from declattn.protocol.messages import NoChunksError, render_messages
from declattn.protocol.prompt import RenderedPrompt
from declattn.protocol.segment import Chunk, SegmentError, segment, token_counter

DEFAULT_KV_TOKENS = 160 * 1024
SCAFFOLD_OVERHEAD = 64
"""Tokens of a DA prompt's scaffold besides the sink and the instruction: the question
and the turn headers around it (an estimate; the gate needs no more precision)."""
CONSTRAIN_BELOW_PARAMS = 1_000_000_000
"""``DAOptions(constrain=None)`` turns the focus constraint on for models smaller than this:
they are the ones that write malformed declarations."""


class RunVanilla(Exception):
    """A DA request that runs as a vanilla one; the message says why (for its usage)."""


@dataclass(frozen=True)
class Load:
    """Sequences in the engine now: being prefilled (or waiting to be) and decoding."""

    waiting: int = 0
    running: int = 0





class Engine:
    """A loaded model with a paged KV cache, answering DA and vanilla requests."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_tokens: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_budget: int | None = None,
        prefill_first: bool = False,
        prefix_caching: bool = True,
        batch_invariant: bool = False,
        kv_disk: bool = True,
        kv_cache_dir: str | Path | None = None,
        kv_cache_size: int | str | None = None,
        model_name: str | None = None,
    ) -> None:
        """``kv_tokens`` sizes the KV pool shared by all sequences in flight; by default
        ``DEFAULT_KV_TOKENS``, or one sequence of the model's whole context if that is
        less (a batch of many sequences asks for more explicitly). The pool is allocated
        on first use, so an engine that only hands its model to ``with_pool`` costs none.

        ``prefix_caching``: a prompt that starts like an earlier one takes over the
        earlier one's K/V for that part instead of computing it again (the second
        question over a document, the next turn of a chat, every arm of an evaluation
        after the first); results are bit for bit those of a fresh prefill.

        ``kv_disk``: the prefix cache also keeps whole prefill chunks on disk, so a later
        process asking over the same document reads its K/V instead of computing it
        (``engine/kvdisk``); under ``kv_cache_dir`` (default ``$DECLATTN_KV_CACHE_DIR``,
        else ``~/.cache/declattn/kv``), at most ``kv_cache_size`` bytes (or ``"20G"``;
        default 20 GiB, or half the disk's free space if less). A model built in memory
        (no files) gets it only with an explicit ``kv_cache_dir``. ``model_name``: what
        ``declattn cache ls`` shows (``from_pretrained`` passes the name it was given).

        ``prefill_budget``, ``prefill_first``: how a step shares its forward between the
        running sequences and a waiting prompt (``engine/scheduler.py``)."""
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source}: the model has no tokenizer")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens must be at least 1, got {kv_tokens}")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if kv_tokens is None:
            limit = loaded.config.max_position_embeddings
            kv_tokens = min(DEFAULT_KV_TOKENS, limit + block_size)
        self._num_blocks = -(-kv_tokens // block_size)
        self._block_size = block_size
        self._prefill_chunk = prefill_chunk
        self._prefill_budget = prefill_budget
        self._prefill_first = prefill_first
        self._prefix_caching = prefix_caching
        self._batch_invariant = batch_invariant
        # the prefix cache's disk tier (#43)
        self._kv_disk = kv_disk
        self._kv_cache_dir = Path(kv_cache_dir).expanduser() if kv_cache_dir else None
        self._kv_cache_size = parse_size(kv_cache_size) if kv_cache_size is not None else None
        self._model_name = model_name or loaded.source.name or "in-memory weights"
        self._core: PagedEngine | None = None
        self.n_params = sum(p.numel() for p in loaded.model.parameters())
        self.da_defaults = model_da_defaults(loaded.weights_dir)
        self.focus_vocabs = VocabCache()
        self.find_vocabs = VocabCache(FindVocab.from_tokenizer)
        self.opening_vocabs = VocabCache(OpeningVocab.from_tokenizer)

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a shipped model by name, a GGUF file or a Hugging Face directory.

        ``dtype`` ``None`` or ``"auto"``: on a CPU a GGUF's matrices stay in the file's own
        quantization (packed 4-bit/int8 layers, bf16 activations: a decode step reads a
        fraction of the bytes); a directory loads in the device's default dtype. A named
        dtype (``"bf16"``, ``"fp32"``, ``"fp16"`` or a ``torch.dtype``) loads every
        weight dense in it."""
        if dtype == "auto":
            dtype = None
        if isinstance(dtype, str):
            dtype = {
                "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16,
                "fp32": torch.float32,
                "float32": torch.float32,
                "fp16": torch.float16,
            }[dtype]
        kwargs.setdefault("model_name", str(path_or_name))
        return cls(load_model(resolve_model(path_or_name), dtype=dtype, device=device), **kwargs)

    def with_pool(
        self,
        num_blocks: int,
        *,
        prefix_caching: bool | None = None,
        batch_invariant: bool | None = None,
        prefill_budget: int | None = None,
        prefill_first: bool | None = None,
    ) -> Engine:
        """The same loaded model (and tokenizer, DA defaults, vocabulary cache) over a
        KV pool of its own of ``num_blocks`` blocks: a server's pool, a test's small one.
        The other settings keep this engine's unless given."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        other = Engine.__new__(Engine)
        other.__dict__.update(self.__dict__)
        other._num_blocks = num_blocks
        if prefix_caching is not None:
            other._prefix_caching = prefix_caching
        if batch_invariant is not None:
            other._batch_invariant = batch_invariant
        if prefill_budget is not None:
            other._prefill_budget = prefill_budget
        if prefill_first is not None:
            other._prefill_first = prefill_first
        other._core = None
        return other

    @property
    def prefix_caching(self) -> bool:
        return self._prefix_caching

    @property
    def _engine(self) -> PagedEngine:
        if self._core is None:
            self._core = PagedEngine(
                self.loaded.model,
                self.tokenizer,
                num_blocks=self._num_blocks,
                block_size=self._block_size,
                prefill_chunk=self._prefill_chunk,
                prefill_budget=self._prefill_budget,
                prefill_first=self._prefill_first,
                prefix_caching=self._prefix_caching,
                batch_invariant=self._batch_invariant,
                kv_disk=self._disk_options(),
            )
        return self._core

    def _disk_options(self) -> DiskOptions | None:
        """The disk tier's options, if it is on (#43): ``None`` without prefix caching,
        with ``kv_disk=False``, or for a model with no files and no directory asked for."""
        if not (self._prefix_caching and self._kv_disk):
            return None
        source = self.loaded.source if self.loaded.weights_dir is not None else None
        return disk_options(self.loaded.model, source, self._model_name, self._kv_cache_dir,
                            self._kv_cache_size, kv_cache_root())

    def allocate(self) -> PoolStats:
        """Make the KV pool now rather than at the first request: a pool larger than the
        memory available is refused (``MemoryShortage``) before a server takes any
        request, and the pool (zero-filled, so resident) is paid at start-up, not by the
        first client."""
        return self._engine.cache.stats()

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_positions(self) -> int:
        """Positions the model can attend to (prompt plus response)."""
        return self.loaded.config.max_position_embeddings

    @property
    def pool(self) -> PoolStats:
        """The KV pool's size and occupancy now."""
        if self._core is None:
            return PoolStats.empty(self._num_blocks, self._block_size)
        return self._core.cache.stats()

    @property
    def decode_route(self) -> DecodeRoute:
        """How the model's decode steps run (chosen at load: ``engine/route.py``), why, and
        the decode steps that could not take it, by reason."""
        return self.loaded.model.decode_route

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element type, as torch names it without its prefix."""
        return str(self._engine.cache.config.dtype).removeprefix("torch.")

    # -- batches -------------------------------------------------------------------
    def add(self, controller: Controller, params: SamplingParams) -> Request:
        """Queue a sequence for ``controller``; ``step`` prefills, then decodes it."""
        return self._engine.add(controller, params)

    def step(self) -> list[TokenEvent]:
        """One forward: a decode row of every running sequence (more where forced tokens
        wait) and a piece of a waiting prompt beside them (``engine/scheduler.py``)."""
        return self._engine.step()

    def next_batch(self) -> list[Request]:
        """The sequences the next ``step`` works on (the running ones, and the waiting one
        whose piece goes along)."""
        return self._engine.next_batch()

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop ``request`` now and free its blocks."""
        self._engine.abort(request, reason)

    def run(self, request: Request) -> Iterator[TokenEvent]:
        """Step until ``request`` finishes, yielding its events (others advance too)."""
        return self._engine.run(request)

    @property
    def load(self) -> Load:
        core = self._core
        return Load() if core is None else Load(len(core.waiting), len(core.running))

    @property
    def has_work(self) -> bool:
        return self._core is not None and self._core.has_work

    def block_keys(self, request: Request) -> SequenceKeys:
        """Read access to ``request``'s stored keys (for key-aware block selection)."""
        return SequenceKeys(self._engine.cache, request.seq_id)

    def prefill_synthetic(
        self, request: Request, upto: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Fill ``request``'s first prompt positions with random K/V (decode benchmarks:
        a step's cost does not depend on the values it reads)."""
        self._engine.prefill_synthetic(request, upto, generator)

    # -- requests ------------------------------------------------------------------
    def da_options(self, options: DAOptions | None = None) -> DAOptions:
        """``options`` (the model's own defaults when None) with the focus constraint
        decided: ``constrain=None`` turns it on for models under 1B parameters."""
        options = options or self.da_defaults
        if options.constrain is None:
            small = self.n_params < CONSTRAIN_BELOW_PARAMS
            options = dataclasses.replace(options, constrain=small)
        return options

    def session(
        self,
        context: str,
        question: str,
        *,
        da: bool = True,
        options: DAOptions | None = None,
        max_tokens: int | None = None,
        history: Sequence[tuple[str, str]] = (),
        chunks: Sequence[Chunk] | None = None,
        shared_prefix: bool = False,
        batch: int | None = None,
    ) -> Session:
        """The session for one request: DA (masking on or off) or vanilla.

        ``max_tokens`` is the response's budget, which the runaway guard needs to tell
        when an answer can no longer fit. ``history``: earlier ``(question, reply)`` turns
        of a conversation over ``context``; ``chunks``: its magic chunks if already cut.
        ``shared_prefix`` (vanilla only): the plain question over the DA prompt's own
        transcript of the chunks (``PlainSession.over_chunks``), so it shares the
        document's prefix, and its prefill, with the DA questions over it. ``batch``:
        the requests this one will decode beside, itself included, for the gate
        (default: one more than the engine holds now).
        """
        if not question.strip():
            raise ValueError("the question is empty")
        if da:
            if chunks is None and not context.strip():  # before the gate: nothing to cut
                raise SegmentError("the context is empty: there is nothing to cut into chunks")
            options = self.da_options(options)
            gate = self._below_min_context(context, chunks, options, batch)
            if gate is not None:
                sess = self.session(context, question, da=False, history=history)
                sess.note = gate
                return sess
            focus, find = self._vocabs(options)
            return DASession(
                self.tokenizer,
                context,
                question,
                options,
                self.block_size,
                max_tokens=max_tokens,
                focus_vocab=focus,
                find_vocab=find,
                opening_vocab=self._opening_vocab(options),
                history=history,
                chunks=chunks,
            )
        if not context.strip():
            raise ValueError("the context is empty")
        if shared_prefix:
            o = self.da_options(options)
            if chunks is None:
                chunks = segment(context, token_counter(self.tokenizer), o.target, o.cap)
            return PlainSession.over_chunks(
                self.tokenizer, chunks, question, self.block_size, o, history
            )
        return PlainSession.for_question(
            self.tokenizer, context, question, self.block_size, history
        )

    def _below_min_context(
        self, context: str, chunks: Sequence[Chunk] | None, options: DAOptions,
        batch: int | None = None,
    ) -> str | None:
        """Why a DA request runs vanilla, when it is not expected to pay: under the
        options' ``min_context`` where one is set, else where the whole DA reply is
        expected to read more bytes than the plain reply (``declattn.da.gate``)."""
        n = sum(c.tokens for c in chunks) if chunks else token_counter(self.tokenizer)(context)
        if options.min_context is not None:
            if n >= options.min_context:
                return None
            return (
                f"ran vanilla: a context of {n} tokens is under min_context "
                f"{options.min_context}"
            )
        if batch is None:
            load = self.load
            batch = 1 + load.running + load.waiting  # they will decode beside this one
        cost = self.reply_cost(n, options, batch)
        if cost.run_da:
            return None
        beside = f" beside {batch - 1} other requests" if batch > 1 else ""
        return (
            f"ran vanilla: at {n} context tokens{beside} a DA reply is expected to read "
            f"{cost.ratio:.2f}x the plain reply's bytes (docs/eval.md, 'The per-answer study')"
        )

    def reply_cost(self, context_tokens: int, options: DAOptions, batch: int = 1) -> ReplyCost:
        """The expected bytes of a DA reply against the plain reply over a context of
        ``context_tokens``, for this model's weights and KV (``declattn.da.gate``), with
        ``batch`` requests decoding together (sharing each forward's weights: a request
        asked while others run joins their steps)."""
        count = token_counter(self.tokenizer)
        scaffold = options.sink + count(options.instruction) + SCAFFOLD_OVERHEAD
        c = self.loaded.config
        itemsize = next(self.loaded.model.parameters()).element_size()
        return expected_cost(
            context_tokens=context_tokens,
            prompt_tokens=context_tokens + scaffold,
            scaffold_tokens=scaffold,
            chunk_tokens=min(options.target, context_tokens),
            weight_bytes=self.loaded.model.weight_bytes_per_step(),
            kv_bytes_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize,
            shape=ECONOMY_SHAPE if options.scaffold_local else CLASSIC_SHAPE,
            batch=batch,
        )

    def messages_session(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        options: DAOptions | None = None,
        max_tokens: int | None = None,
    ) -> DASession:
        """A DA session over a chat whose earlier messages are the magic chunks (tool
        results, documents, earlier turns; ``protocol/messages.py``), its last user
        message the question. A follow-up that extends the same chat renders the same
        prefix, so the prefix cache prefills a growing transcript once.

        Raises ``RunVanilla`` where DA has nothing to skip (no earlier message with
        text) or would read more than vanilla (the chat is under ``min_context``)."""
        options = self.da_options(options)
        try:
            prompt = render_messages(
                self.tokenizer, messages, tools=tools, target=options.target, cap=options.cap,
                sink=options.sink, instruction=options.instruction,
            )
        except NoChunksError as e:
            raise RunVanilla(f"ran vanilla: {e}") from e
        chunks = [Chunk(c.id, c.chars[0], c.chars[1], c.text, len(c.span)) for c in prompt.chunks]
        gate = self._below_min_context("", chunks, options)
        if gate is not None:
            raise RunVanilla(gate)
        rendered = RenderedPrompt(prompt.token_ids, prompt.layout, prompt.text, "messages")
        focus, find = self._vocabs(options)
        return DASession.over(
            self.tokenizer, rendered, chunks, options, self.block_size, max_tokens=max_tokens,
            focus_vocab=focus, find_vocab=find, opening_vocab=self._opening_vocab(options),
        )

    def _vocabs(self, options: DAOptions) -> tuple[FocusVocab | None, FindVocab | None]:
        """The constraint vocabularies ``options`` needs, built once per tokenizer."""
        if not options.constrain:
            return None, None
        ids = self.focus_vocabs.get(self.tokenizer) if options.focus != "find" else None
        find = self.find_vocabs.get(self.tokenizer) if options.focus != "ids" else None
        return ids, find

    def _opening_vocab(self, options: DAOptions) -> OpeningVocab | None:
        """The tag tokens, where ``options`` asks that the reply open with a tag or that
        the answer follow a find focus."""
        return self.opening_vocabs.get(self.tokenizer) if options.needs_tag_vocab else None

    def open(self, context: str, options: DAOptions | None = None) -> Document:
        """A handle for asking ``context`` many questions: it is cut into magic chunks
        once, and its prefill is paid once (the prefix cache keeps its K/V)."""
        return Document(self, context, options)

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
        return self.stream(sess, params, on_prefill, result)

    def stream(
        self,
        sess: Session,
        params: SamplingParams,
        on_prefill: Callable[[int, int], None] | None = None,
        result: list[Answer] | None = None,
        controller: Controller | None = None,
    ) -> Iterator[Delta]:
        """Run ``sess`` to its end, streaming what it may show (tags decided first).
        ``controller``: what the engine drives instead of ``sess`` itself, a wrapper
        around it (teacher forcing in tests and benchmarks)."""
        req = self.add(controller or sess, params)
        while req.finish_reason is None and req.prefilled < len(req.prompt_ids):
            self.step()
            if on_prefill is not None:
                on_prefill(req.prefilled, len(req.prompt_ids))
        shown = 0
        index = 0  # the first token came from the prefill step
        while True:
            finished = req.finish_reason is not None
            end = sess.visible_end(finished)
            text = sess.text[shown:end]
            shown = max(shown, end)
            if text or finished:
                yield Delta(text, sess.mode, sess.focus_ids, index, req.finish_reason)
            if finished:
                break
            self.step()
            index = len(req.output_ids) - 1
        if result is not None:
            result.append(self.answer_of(sess, req))

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

    def answer_of(self, sess: Session, req: Request) -> Answer:
        """The finished ``Answer`` of ``sess``, run as ``req``."""
        acc = sess.accounting
        totals = acc.totals()
        stats = Stats(
            prompt_tokens=len(req.prompt_ids),
            output_tokens=len(req.output_ids),
            decode_steps=sum(1 for r in req.reads if not r.forced),
            prefill_seconds=req.prefill_seconds,
            decode_seconds=req.decode_seconds,
            logical_attended=totals["logical"],
            physical_attended=totals["physical"],
            vanilla_attended=totals["vanilla_logical"],
            vanilla_physical=totals["vanilla_physical"],
            blocks_read=sum(len(r.blocks) for r in req.reads),
            bytes_read=sum(r.global_bytes + r.sliding_bytes for r in req.reads),
            by_mode={str(m): v for m, v in acc.by_mode().items()},
            cached_tokens=req.cached_tokens,
            disk_tokens=req.disk_tokens,
        )
        return Answer(
            text=sess.text,
            answer=sess.answer,
            arm=sess.arm,
            finish_reason=req.finish_reason,
            declarations=list(sess.declarations),
            declines=list(sess.declines),
            stats=stats,
            token_texts=list(req.token_texts),
            session=sess,
            reads=list(req.reads),
            note=sess.note,
        )
