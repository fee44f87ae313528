"""One request, DA or plain: where the protocol (text) and the engine (blocks) meet.

A session is the engine's controller for one sequence. A DA session drives the request's
``DAState`` (``declattn.da.state``): before each decode step it hands the engine the
blocks of the state's scope; after each token it feeds the token's text to the state.
It also counts what each step attended, with the same ``Accounting`` that ``replay``
uses, so a live run and a replay of its transcript give the same figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from declattn.api.constrained import constrain
from declattn.da.accounting import Accounting, StepRecord
from declattn.da.constrain import FocusVocab, TokenConstraint
from declattn.da.constrain_find import FindVocab
from declattn.da.constrain_open import OpeningVocab
from declattn.da.options import DAOptions
from declattn.da.runaway import RunawayGuard
from declattn.da.scope import DEFAULT_BLOCK_SIZE, Scope, StepCount
from declattn.da.state import DAState
from declattn.engine.controller import Controller, ForcedTokens
from declattn.protocol.answer import answer_of
from declattn.protocol.instruction import PLAIN_INSTRUCTION
from declattn.protocol.layout import Layout
from declattn.protocol.modes import Mode
from declattn.protocol.prompt import RenderedPrompt, render_plain, render_prompt
from declattn.protocol.segment import Chunk, segment, token_counter
from declattn.protocol.tags import Declaration, TagReader

if TYPE_CHECKING:
    from torch import Tensor


class Session(Controller):
    """A request above the engine: its prompt, its text so far, and what each decode
    step attended, counted with the same ``Accounting`` that ``replay`` uses.

    The base counts every step as a full read; subclasses decide what is read.
    ``arm`` names how the request runs (vanilla, da, da-nm, a baseline).
    """

    arm = "vanilla"

    def __init__(self, prompt_ids: Sequence[int], block_size: int) -> None:
        super().__init__(prompt_ids)
        self.block_size = block_size
        self.accounting = Accounting()
        self.steps: list[StepRecord] = []
        self.text = ""
        self.n_tokens = 0
        self.note: str | None = None
        """Why the request runs other than as asked (DA asked, vanilla run), if it does."""

    def record(
        self, length: int, count: StepCount, mode: Mode = Mode.GLOBAL, focus_ids: tuple = ()
    ) -> None:
        """Count one decode step that sees ``length`` positions and reads ``count``."""
        rec = StepRecord.from_count(len(self.steps) + 1, mode, focus_ids, length, count)
        self.steps.append(rec)
        self.accounting.add(rec)

    def view(self, length: int) -> Sequence[int] | None:
        self.record(length, StepCount.full(length, self.block_size))
        return None

    def on_token(self, token_id: int, text: str) -> str | None:
        self.text += text
        self.n_tokens += 1
        return None

    def visible_end(self, finished: bool) -> int:
        """How much of ``text`` may be shown now: all of it, for a request without tags."""
        return len(self.text)

    @property
    def mode(self) -> str:
        """The mode the text is being written in, for display ("vanilla" without DA)."""
        return "vanilla"

    @property
    def focus_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def declarations(self) -> tuple[Declaration, ...]:
        return ()

    @property
    def declines(self) -> tuple[Declaration, ...]:
        return ()

    @property
    def answer(self) -> str | None:
        return self.text.strip()


class PlainSession(Session):
    """A vanilla request: ordinary prompt, every step reads everything."""

    @classmethod
    def for_question(
        cls,
        tokenizer: Any,
        context: str,
        question: str,
        block_size: int,
        history: Sequence[tuple[str, str]] = (),
    ) -> PlainSession:
        """The ordinary prompt: context and question in one user turn (after the
        ``history`` turns of a conversation over the same context, if any)."""
        return cls(render_plain(tokenizer, context, question, history), block_size)

    @classmethod
    def over_chunks(
        cls,
        tokenizer: Any,
        chunks: Sequence[Chunk],
        question: str,
        block_size: int,
        options: DAOptions,
        history: Sequence[tuple[str, str]] = (),
    ) -> PlainSession:
        """The plain question over the DA prompt's transcript of ``chunks``: the same
        document turns (so the same prefix, prefilled once for DA and plain alike), then
        a final turn asking for a plain answer (``PLAIN_INSTRUCTION``), no tags."""
        prompt = render_prompt(
            tokenizer, chunks, question, sink=options.sink, style=options.style,
            instruction=PLAIN_INSTRUCTION, history=history,
        )
        return cls(prompt.token_ids, block_size)


class DASession(Session):
    """One DA request: chunks, prompt and layout, tag reader, scope, accounting."""

    arm = "da"

    def __init__(
        self,
        tokenizer: Any,
        context: str,
        question: str,
        options: DAOptions | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        max_tokens: int | None = None,
        focus_vocab: FocusVocab | None = None,
        history: Sequence[tuple[str, str]] = (),
        chunks: Sequence[Chunk] | None = None,
        find_vocab: FindVocab | None = None,
        opening_vocab: OpeningVocab | None = None,
    ) -> None:
        """``history``: earlier ``(question, reply)`` turns of a conversation over the
        same context, rendered before ``question`` and read by every mode. ``chunks``:
        the context's magic chunks when the caller already cut them (a document asked
        many questions is segmented once)."""
        o = options or DAOptions()
        if chunks is None:
            chunks = segment(context, token_counter(tokenizer), o.target, o.cap)
        prompt = render_prompt(
            tokenizer, chunks, question, sink=o.sink, style=o.style,
            instruction=o.instruction_for(chunks, tokenizer), history=history,
        )
        self._start(tokenizer, prompt, chunks, o, block_size, max_tokens, focus_vocab, find_vocab,
                    opening_vocab)

    @classmethod
    def over(
        cls,
        tokenizer: Any,
        prompt: RenderedPrompt,
        chunks: Sequence[Chunk],
        options: DAOptions | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        max_tokens: int | None = None,
        focus_vocab: FocusVocab | None = None,
        find_vocab: FindVocab | None = None,
        opening_vocab: OpeningVocab | None = None,
    ) -> DASession:
        """A session over a prompt rendered elsewhere: a chat whose own messages are the
        magic chunks (``protocol/messages.py``), with ``chunks`` in layout order."""
        if len(chunks) != prompt.layout.n_chunks:
            raise ValueError(f"{len(chunks)} chunks for a layout of {prompt.layout.n_chunks}")
        sess = cls.__new__(cls)
        sess._start(tokenizer, prompt, chunks, options or DAOptions(), block_size, max_tokens,
                    focus_vocab, find_vocab, opening_vocab)
        return sess

    def _start(
        self,
        tokenizer: Any,
        prompt: RenderedPrompt,
        chunks: Sequence[Chunk],
        options: DAOptions,
        block_size: int,
        max_tokens: int | None,
        focus_vocab: FocusVocab | None,
        find_vocab: FindVocab | None = None,
        opening_vocab: OpeningVocab | None = None,
    ) -> None:
        self.options = o = options
        if not o.masking:
            self.arm = "da-nm"
        self.chunks: list[Chunk] = list(chunks)
        self.prompt: RenderedPrompt = prompt
        super().__init__(prompt.token_ids, block_size)
        ids_on = bool(o.constrain) and o.focus in ("ids", "both")
        find_on = bool(o.constrain) and o.focus in ("find", "both")
        tags = None
        if o.needs_tag_vocab:
            tags = opening_vocab or OpeningVocab.from_tokenizer(tokenizer)
        self.state = DAState(
            prompt.layout, [c.text for c in self.chunks], line_start=o.line_start,
            scaffold_local=o.scaffold_local, focus_form=o.focus,
            focus_vocab=(focus_vocab or FocusVocab.from_tokenizer(tokenizer)) if ids_on else None,
            find_vocab=(find_vocab or FindVocab.from_tokenizer(tokenizer)) if find_on else None,
            opening_vocab=tags if o.open_tag else None,
            answer_vocab=tags if o.answer_after_find else None,
            close_at_one_chunk=o.close_find_at_one_chunk,
            runaway=RunawayGuard(max_tokens=max_tokens) if o.runaway else None,
            end_ids=tokenizer.all_special_ids if o.require_answer else (),
        )
        self.expected_views: list[tuple[int, ...]] = []
        self._view_key: tuple | None = None  # what ``_view`` was made for
        self._view: tuple[int, ...] = ()
        self.tokenizer = tokenizer
        self._last_text = ""  # the newest token's text, for token healing
        self._forced_owed = 0  # forced tokens returned and not yet accepted
        self._newest_forced = False  # the newest token was one of them (never healed)

    @property
    def reader(self) -> TagReader:
        return self.state.reader

    @property
    def constraints(self) -> list[TokenConstraint]:
        return self.state.constraints

    @property
    def runaway(self) -> RunawayGuard | None:
        return self.state.runaway

    @property
    def layout(self) -> Layout:
        return self.prompt.layout

    def regions(self, start: int, stop: int) -> list[int]:
        return self.layout.regions(start, stop)

    def scope(self) -> Scope:
        return self.state.scope()

    def view(self, length: int) -> Sequence[int] | None:
        """The blocks the next step reads; also records what that step attends."""
        scope = self.scope()
        masked = self.options.masking
        bs = self.block_size
        count = scope.count(length, bs) if masked else StepCount.full(length, bs)
        self.record(length, count, scope.mode, scope.focus_ids)
        if not masked:
            return None
        blocks = self._kept_blocks(scope, length)
        self.expected_views.append(blocks)
        return blocks

    def _kept_blocks(self, scope: Scope, length: int) -> tuple[int, ...]:
        """``scope``'s kept blocks at ``length``, one tuple while its mode, its chunks and
        the newest block stay (they depend on ``length`` only through the newest block,
        ``Scope.kept_blocks``): a decode step then hands the engine the view of the
        step before, which it extends rather than plans again (``PlanMemo``)."""
        key = (scope.mode, scope.focus_ids, (length - 1) // self.block_size)
        if self._view_key != key:
            self._view_key = key
            self._view = tuple(scope.kept_blocks(length, self.block_size))
        return self._view

    def process_logits(self, logits: Tensor) -> Tensor:
        """Inside a declaration, keep only tokens that lead to a valid one."""
        state = self.state
        return constrain(state.constraints, logits, self.reader.pending, self.n_tokens,
                         state.banned_ids())

    def on_token(self, token_id: int, text: str) -> str | None:
        super().on_token(token_id, text)
        self._last_text = text
        self._newest_forced = self._forced_owed > 0
        self._forced_owed = max(0, self._forced_owed - 1)
        return self.state.feed(token_id, text)

    def forced(self) -> ForcedTokens | None:
        """The tag text the protocol fixes next (``DAState.forced_text``), as tokens the
        engine appends in one forward (``DAOptions.jump_forward``).

        Healed where the newest token was sampled inside the tag being written (the tag
        began before it): that token is not in the KV cache yet, so it is written again
        together with the fixed text, and the tokens are the tokenizer's own for the
        whole piece instead of the fixed text's alone. A tag the newest token began is
        not healed: the step before it read with the state before the tag, and a
        replacement would be asked its view after it."""
        if not self.options.jump_forward:
            return None
        text = self.state.forced_text()
        if text is None:
            return None
        pending, last = self.reader.pending, self._last_text
        heal = (not self._newest_forced and bool(last) and len(pending) > len(last)
                and pending.endswith(last))
        for piece, replaces in ((last + text, True), (text, False)):
            if replaces and not heal:
                continue
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            if ids and self.tokenizer.decode(ids) == piece:
                self._forced_owed = len(ids)
                return ForcedTokens(tuple(ids), replaces_last=replaces)
        return None

    def visible_end(self, finished: bool) -> int:
        """Up to the reader's decided offset: a tag is never shown half written. A
        finished response decides the rest (a dangling candidate is plain text)."""
        if finished:
            self.state.finish()
        return self.reader.safe_end

    @property
    def mode(self) -> str:
        return str(self.reader.mode)

    @property
    def focus_ids(self) -> tuple[int, ...]:
        return self.reader.focus_ids

    @property
    def declarations(self) -> tuple[Declaration, ...]:
        return self.reader.declarations

    @property
    def declines(self) -> tuple[Declaration, ...]:
        return self.reader.declines

    @property
    def answer(self) -> str | None:
        """The text of the first ``<answer>`` block, or None if the model never wrote one."""
        return answer_of(self.text, self.declarations)
