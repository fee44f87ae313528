"""Per-request DA settings, and a model directory's own defaults for them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from declattn.protocol.index import chunk_index
from declattn.protocol.instruction import (
    DA_INSTRUCTION,
    ECONOMY_INSTRUCTION,
    FIND_INSTRUCTION,
    find_instruction,
)
from declattn.protocol.segment import Chunk, token_counter


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
    shorter than this many tokens runs vanilla (and says so); ``None`` decides by the
    expected cost of the whole reply (``declattn.da.gate``), 0 never falls back. ``scaffold_local``:
    steps that write protocol text (a tag, the space between blocks) read only what
    ``<local>`` reads (``declattn.da.state``). ``jump_forward``: text the protocol fixes
    (the rest of a tag once it is decided) is appended in one forward instead of one
    decode step a token (``DAState.forced_text``). ``require_answer``: a response that has
    written a tag may not end (a special token) before it has opened an ``<answer>``.
    ``open_tag``: the response's first token must begin a tag (``constrain_open.py``), so
    a reply cannot start in prose and read everything. ``answer_after_find``: ``<answer>``
    comes right after a find focus's tag (``constrain_open.py``), so the answer is written
    from the focused chunk without copying the fact first. ``close_find_at_one_chunk``:
    a find phrase is closed as soon as it names one chunk for good (whole words wherever
    it occurs, an exact match in one chunk): more words would read the same chunk and
    cost a decode step each. Fixed text (appended in one forward with ``jump_forward``),
    held by the find constraint without it where the constraint is on.
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
    scaffold_local: bool = False
    jump_forward: bool = False
    require_answer: bool = False
    open_tag: bool = False
    answer_after_find: bool = False
    close_find_at_one_chunk: bool = False

    def __post_init__(self) -> None:
        if self.focus not in FOCUS_FORMS:
            raise ValueError(f"focus must be one of {', '.join(FOCUS_FORMS)}, not {self.focus!r}")
        if self.index < 0 or (self.min_context is not None and self.min_context < 0):
            raise ValueError("index and min_context must be >= 0")

    @classmethod
    def economy(cls, **changes: Any) -> DAOptions:
        """The economical protocol (docs/protocol.md): a find focus with the answer
        written inside it (``ECONOMY_INSTRUCTION``), the find constraint, scaffold steps
        read as local, forced tag text appended in one forward, no end before an answer,
        a reply that opens with a tag, and the answer right after a find focus. Not the
        close of a find phrase at one chunk (``close_find_at_one_chunk``): it saves
        forwards, but cost an answer in ``declattn demo`` (docs/eval.md)."""
        base: dict[str, Any] = {
            "focus": "find", "instruction": ECONOMY_INSTRUCTION, "constrain": True,
            "scaffold_local": True, "jump_forward": True, "require_answer": True,
            "open_tag": True, "answer_after_find": True,
        }
        return cls(**{**base, **changes})

    @property
    def needs_tag_vocab(self) -> bool:
        """Whether a rule fixes tag tokens (``open_tag``, ``answer_after_find``), which
        needs the tokenizer's tag vocabulary (``constrain_open.OpeningVocab``)."""
        return self.open_tag or self.answer_after_find

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
    """``DAOptions`` with the fields the model directory's settings file sets; for a model
    without one (an off-the-shelf model), the economical protocol, whose whole reply
    reads less than the plain reply (docs/eval.md, "The per-answer study"), with the constraint
    left to the engine (on for small models)."""
    path = directory / MODEL_SETTINGS_FILE if directory is not None else None
    if path is None or not path.is_file():
        return DAOptions.economy(constrain=None)
    try:
        raw = json.loads(path.read_text())["da"]
        return DAOptions(**raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad DA settings ({e})") from e
