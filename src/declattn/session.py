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
from declattn.constrain import FocusConstraint, FocusVocab
from declattn.protocol.instruction import DA_INSTRUCTION
from declattn.protocol.layout import Layout
from declattn.protocol.modes import Mode
from declattn.protocol.prompt import RenderedPrompt, render_plain, render_prompt
from declattn.protocol.segment import Chunk, segment
from declattn.protocol.tags import Declaration, TagReader
from declattn.runaway import RunawayGuard
from declattn.scope import DEFAULT_BLOCK_SIZE, Scope, StepCount

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class DAOptions:
    """Per-request DA settings. ``masking=False`` is the DA-nm arm (DA prompt, full reads).

    ``constrain``: mask the logits inside a focus declaration so only valid ones can be
    written; ``None`` lets ``Engine.session`` decide (on for models under 1B parameters),
    and a session built directly treats it as off. ``runaway``: stop loops and responses
    that can no longer reach ``<answer>`` (see ``runaway.py``). ``instruction`` opens the
    final user turn: the demonstration for off-the-shelf models, the brief line for
    models trained to declare.
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


def token_counter(tokenizer: Any):
    """The served tokenizer's count, as the segmenter wants it."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def _full_count(length: int, block_size: int) -> StepCount:
    physical = -(-length // block_size) * block_size
    return StepCount(length, physical, length, physical)


class PlainSession:
    """A vanilla request: ordinary prompt, every step reads everything."""

    mode_name = "vanilla"

    def __init__(self, tokenizer: Any, context: str, question: str, block_size: int) -> None:
        self.prompt_ids = render_plain(tokenizer, context, question)
        self.block_size = block_size
        self.accounting = Accounting()
        self.steps: list[StepRecord] = []
        self.text = ""

    def view(self, length: int) -> Sequence[int] | None:
        count = _full_count(length, self.block_size)
        record = StepRecord.from_count(len(self.steps) + 1, Mode.GLOBAL, (), length, count)
        self.steps.append(record)
        self.accounting.add(record)
        return None

    def on_token(self, token_id: int, text: str) -> str | None:
        self.text += text
        return None

    @property
    def answer(self) -> str:
        return self.text.strip()


class DASession:
    """One DA request: chunks, prompt and layout, tag reader, scope, accounting."""

    mode_name = "da"

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
    ) -> None:
        self.options = options or DAOptions()
        if not self.options.masking:
            self.mode_name = "da-nm"
        o = self.options
        self.chunks: list[Chunk] = segment(context, token_counter(tokenizer), o.target, o.cap)
        self.prompt: RenderedPrompt = render_prompt(
            tokenizer, self.chunks, question, sink=o.sink, style=o.style, instruction=o.instruction
        )
        self.reader = TagReader(len(self.chunks), line_start=o.line_start)
        self.accounting = Accounting()
        self.steps: list[StepRecord] = []
        self.block_size = block_size
        self.expected_views: list[tuple[int, ...]] = []
        self.text = ""
        self.n_tokens = 0
        self.constraint: FocusConstraint | None = None
        if o.constrain:
            vocab = focus_vocab or FocusVocab.from_tokenizer(tokenizer)
            self.constraint = FocusConstraint(vocab, len(self.chunks))
        self.runaway = RunawayGuard(max_tokens=max_tokens) if o.runaway else None

    @property
    def layout(self) -> Layout:
        return self.prompt.layout

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids

    def scope(self) -> Scope:
        return Scope(self.layout, self.reader.mode, self.reader.focus_ids)

    def view(self, length: int) -> Sequence[int] | None:
        """The blocks the next step reads; also records what that step attends."""
        scope = self.scope()
        if self.options.masking:
            count = scope.count(length, self.block_size)
        else:
            count = _full_count(length, self.block_size)
        record = StepRecord.from_count(
            len(self.steps) + 1, scope.mode, scope.focus_ids, length, count
        )
        self.steps.append(record)
        self.accounting.add(record)
        if not self.options.masking:
            return None
        blocks = tuple(scope.kept_blocks(length, self.block_size))
        self.expected_views.append(blocks)
        return blocks

    def process_logits(self, logits: Tensor) -> Tensor:
        """Inside a focus declaration, keep only tokens that lead to a valid one."""
        if self.constraint is None:
            return logits
        return self.constraint.apply(logits, self.reader.pending, self.n_tokens)

    def on_token(self, token_id: int, text: str) -> str | None:
        self.text += text
        self.n_tokens += 1
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

    @property
    def declarations(self) -> tuple[Declaration, ...]:
        return self.reader.declarations

    @property
    def declines(self) -> tuple[Declaration, ...]:
        return self.reader.declines

    @property
    def answer(self) -> str | None:
        """The text of the first ``<answer>`` block, or None if the model never wrote one."""
        opened = [d for d in self.declarations if d.kind == "answer" and d.accepted]
        if not opened:
            return None
        start = opened[0].end
        closed = [d for d in self.declarations if d.kind == "/answer" and d.start >= start]
        end = closed[0].start if closed else len(self.text)
        return self.text[start:end].strip()
