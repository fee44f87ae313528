"""One request, DA or plain: where the protocol (text) and the engine (blocks) meet.

A session is the engine's controller for one sequence. Before each decode step it
turns the tag reader's state into a scope and hands the engine that scope's blocks;
after each token it feeds the token's text to the tag reader. It also counts what
each step attended, with the same ``Accounting`` that ``replay`` uses, so a live run
and a replay of its transcript give the same figures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from declattn.accounting import Accounting, StepRecord
from declattn.constrain import FocusConstraint, FocusVocab, LogitsConstraint
from declattn.constrain_find import FindConstraint, FindVocab
from declattn.engine.controller import Controller
from declattn.protocol.answer import answer_of
from declattn.protocol.find import PhraseFinder
from declattn.protocol.index import chunk_index
from declattn.protocol.instruction import DA_INSTRUCTION, FIND_INSTRUCTION, find_instruction
from declattn.protocol.layout import Layout
from declattn.protocol.modes import Mode
from declattn.protocol.prompt import RenderedPrompt, render_plain, render_prompt
from declattn.protocol.segment import Chunk, segment, token_counter
from declattn.protocol.tags import Declaration, TagReader
from declattn.runaway import RunawayGuard
from declattn.scope import DEFAULT_BLOCK_SIZE, Scope, StepCount

if TYPE_CHECKING:
    from torch import Tensor


MIN_CONTEXT_CHUNKS = 1.5
"""The default break-even, in chunks of ``DAOptions.target``: a shorter context runs
vanilla. Measured on qwen2.5-0.5b (planted facts, 3-5 documents per length, 2026-12-01,
docs/eval.md "Break-even"): with 2,048-token chunks, DA read more tokens per decode step
than vanilla at 2K (1.04x with chunk ids; one chunk holds nearly everything, and the DA
prompt is longer) and fewer from 3K on (0.88x ids, 0.68x find; 0.57x / 0.35x at 16K).
Below 1.5 chunks a focus keeps two thirds of the context or more, which the
instruction's tokens outweigh."""


@dataclass(frozen=True)
class DAOptions:
    """Per-request DA settings. ``masking=False`` is the DA-nm arm (DA prompt, full reads).

    ``constrain``: mask the logits inside a focus declaration so only valid ones can be
    written; ``None`` lets ``Engine.session`` decide (on for models under 1B parameters),
    and a session built directly treats it as off. ``runaway``: stop loops and responses
    that can no longer reach ``<answer>`` (see ``runaway.py``). ``instruction`` opens the
    final user turn: the demonstration for off-the-shelf models, the brief line for
    models trained to declare. ``focus``: the focus form the instruction teaches and the
    constraint guards — ``ids`` (``magic_chunks="K"``, a global survey first), ``find``
    (``<focus find="WORDS">``: the engine looks the words up in the chunks, no survey) or
    ``both`` (the find instruction, both constraints); the reader accepts either form
    whatever is chosen. ``index``: a token budget for an in-context index of the chunks
    (one line each, in the find instruction); 0 is none. ``min_context``: a context
    shorter than this many tokens runs vanilla (and says so); ``None`` is
    ``MIN_CONTEXT_CHUNKS`` times ``target``, 0 never falls back.
    """

    target: int = 2048
    cap: int = 2560
    sink: int = 16
    line_start: bool = False
    masking: bool = True
    style: str = "auto"
    constrain: bool | None = None
    runaway: bool = True
    instruction: str = DA_INSTRUCTION
    min_context: int | None = None
    focus: str = "ids"
    index: int = 0

    def __post_init__(self) -> None:
        if self.focus not in FOCUS_FORMS:
            raise ValueError(f"focus must be one of {', '.join(FOCUS_FORMS)}, not {self.focus!r}")
        if self.index < 0 or (self.min_context is not None and self.min_context < 0):
            raise ValueError("index and min_context must be >= 0")

    @property
    def context_floor(self) -> int:
        """The shortest context that runs DA: ``min_context``, or by default
        ``MIN_CONTEXT_CHUNKS`` chunks' worth of ``target`` tokens."""
        if self.min_context is not None:
            return self.min_context
        return round(MIN_CONTEXT_CHUNKS * self.target)

    def instruction_for(self, chunks: Sequence[Chunk], tokenizer: Any) -> str:
        """The instruction this request's prompt opens with: the model's own if it has
        one, else the one teaching ``focus`` (with the chunk index if asked)."""
        if self.instruction != DA_INSTRUCTION or self.focus == "ids":
            return self.instruction
        if not self.index:
            return FIND_INSTRUCTION
        lines = chunk_index([c.text for c in chunks], token_counter(tokenizer), self.index)
        return find_instruction(lines)


FOCUS_FORMS = ("ids", "find", "both")

MODEL_SETTINGS_FILE = "declattn.json"
"""A model directory's own DA defaults (``{"da": {DAOptions field: value}}``): a model
trained to declare knows its chunk size and instruction."""


def model_da_defaults(directory: Path | None) -> DAOptions:
    """``DAOptions`` with the fields the model directory's settings file sets."""
    path = directory / MODEL_SETTINGS_FILE if directory is not None else None
    if path is None or not path.is_file():
        return DAOptions()
    try:
        raw = json.loads(path.read_text())["da"]
        return DAOptions(**raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad DA settings ({e})") from e


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
        self._start(tokenizer, prompt, chunks, o, block_size, max_tokens, focus_vocab, find_vocab)

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
    ) -> DASession:
        """A session over a prompt rendered elsewhere: a chat whose own messages are the
        magic chunks (``protocol/messages.py``), with ``chunks`` in layout order."""
        if len(chunks) != prompt.layout.n_chunks:
            raise ValueError(f"{len(chunks)} chunks for a layout of {prompt.layout.n_chunks}")
        sess = cls.__new__(cls)
        sess._start(tokenizer, prompt, chunks, options or DAOptions(), block_size, max_tokens,
                    focus_vocab, find_vocab)
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
    ) -> None:
        self.options = o = options
        if not o.masking:
            self.arm = "da-nm"
        self.chunks: list[Chunk] = list(chunks)
        self.prompt: RenderedPrompt = prompt
        super().__init__(prompt.token_ids, block_size)
        self.finder = PhraseFinder([c.text for c in self.chunks])
        self.reader = TagReader(len(self.chunks), line_start=o.line_start, finder=self.finder)
        self.expected_views: list[tuple[int, ...]] = []
        self._last_view: tuple[tuple, tuple[int, ...]] | None = None
        self.constraints: list[LogitsConstraint] = []
        if o.constrain and o.focus in ("ids", "both"):
            vocab = focus_vocab or FocusVocab.from_tokenizer(tokenizer)
            self.constraints.append(FocusConstraint(vocab, len(self.chunks)))
        if o.constrain and o.focus in ("find", "both"):
            find = FindConstraint(find_vocab or FindVocab.from_tokenizer(tokenizer), self.finder)
            find.prepare()  # its index is built now, not on the first step inside a tag
            self.constraints.append(find)
        self.runaway = RunawayGuard(max_tokens=max_tokens) if o.runaway else None

    @property
    def layout(self) -> Layout:
        return self.prompt.layout

    def regions(self, start: int, stop: int) -> list[int]:
        return self.layout.regions(start, stop)

    def scope(self) -> Scope:
        return Scope(self.layout, self.reader.mode, self.reader.focus_ids)

    def view(self, length: int) -> Sequence[int] | None:
        """The blocks the next step reads; also records what that step attends."""
        scope = self.scope()
        masked = self.options.masking
        bs = self.block_size
        count = scope.count(length, bs) if masked else StepCount.full(length, bs)
        self.record(length, count, scope.mode, scope.focus_ids)
        if not masked:
            return None
        # The same scope over the same blocks is the same view: one tuple, which the
        # engine then recognises as unchanged and whose plan it carries (runs.PlanCarry).
        key = (scope.mode, scope.focus_ids, -(-length // bs))
        if self._last_view is None or self._last_view[0] != key:
            self._last_view = (key, tuple(scope.kept_blocks(length, bs)))
        blocks = self._last_view[1]
        self.expected_views.append(blocks)
        return blocks

    def process_logits(self, logits: Tensor) -> Tensor:
        """Inside a focus declaration, keep only tokens that lead to a valid one."""
        for constraint in self.constraints:
            logits = constraint.apply(logits, self.reader.pending, self.n_tokens)
        return logits

    def on_token(self, token_id: int, text: str) -> str | None:
        super().on_token(token_id, text)
        for d in self.reader.feed(text):
            if d.kind == "/answer" and d.accepted:
                return "answer"
        if self.runaway is not None:
            return self.runaway.on_token(token_id, text, self._answer_open())
        return None

    def _answer_open(self) -> bool:
        if any(d.kind == "answer" and d.accepted for d in self.reader.declarations):
            return True
        pending = self.reader.pending
        return bool(pending) and (pending.startswith("<answer") or "<answer".startswith(pending))

    def visible_end(self, finished: bool) -> int:
        """Up to the reader's decided offset: a tag is never shown half written. A
        finished response decides the rest (a dangling candidate is plain text)."""
        if finished and not self.reader.finished:
            self.reader.finish()
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
