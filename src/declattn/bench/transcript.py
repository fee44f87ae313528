"""A planted-fact document and a DA transcript to teacher-force over it.

The end-to-end decode benchmark must replay one and the same output under DA masking
and under vanilla masking, so the output is written here, not sampled: a global
section that finds the fact's chunk, a focus section on that chunk and a neighbour, a
local section, and an answer. Section lengths follow a target mix of tokens per mode
(about a quarter in global, as in the transcripts the paper reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from declattn.bench.segment import sample_text
from declattn.protocol.modes import Mode
from declattn.protocol.segment import token_counter
from declattn.protocol.tags import TagReader

FACT = "The keeper's logbook says that the vault code of the north tower is 4721."
QUESTION = "What is the vault code of the north tower, according to the document?"
ANSWER = "The vault code of the north tower is 4721."

_FILLER = (
    "The essay moves from the beacon fires of the ancient coast to the lamps of the "
    "modern age. ",
    "Each section describes keepers, towers, lenses and the ships they guarded. ",
    "The passage about the north tower mentions a logbook kept by the keeper. ",
    "That logbook records the code of the vault in plain words. ",
    "Nothing in the other sections contradicts what the logbook says. ",
    "So the code can be read directly from that sentence. ",
)


def repeated_essay(tokenizer: Any, n_tokens: int, depth: float = 0.6) -> str:
    """The bundled essay repeated to about ``n_tokens`` tokens, with ``FACT`` planted as
    its own paragraph at ``depth`` (0 = start, 1 = end) of the text."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    unit = sample_text().rstrip("\n") + "\n\n"
    count = token_counter(tokenizer)
    reps = max(1, -(-n_tokens // max(1, count(unit))))
    paragraphs = (unit * reps).split("\n\n")
    paragraphs = [p for p in paragraphs if p.strip()]
    # Trim to the budget by characters, a cheap proxy (the essay is plain prose).
    total_chars = sum(len(p) + 2 for p in paragraphs)
    budget = total_chars * n_tokens / max(1, count("\n\n".join(paragraphs)))
    kept, used = [], 0
    for p in paragraphs:
        if used + len(p) + 2 > budget and kept:
            break
        kept.append(p)
        used += len(p) + 2
    at = min(len(kept), max(1, round(depth * len(kept))))
    kept.insert(at, FACT)
    return "\n\n".join(kept) + "\n"


@dataclass(frozen=True)
class Mix:
    """Target share of generated tokens per mode (the answer takes the rest)."""

    global_: float = 0.27
    focus: float = 0.40
    local: float = 0.23

    def __post_init__(self) -> None:
        if min(self.global_, self.focus, self.local) < 0 or self.answer < 0:
            raise ValueError("mode shares must be non-negative and sum to at most 1")

    @property
    def answer(self) -> float:
        return 1.0 - self.global_ - self.focus - self.local


def _section(tokenizer: Any, lead: str, n_tokens: int, salt: int) -> str:
    """``lead`` then filler, cut to about ``n_tokens`` tokens (never less than the lead)."""
    text, i = lead, salt
    while token_counter(tokenizer)(text) < n_tokens:
        text += _FILLER[i % len(_FILLER)]
        i += 1
    ids = tokenizer.encode(text, add_special_tokens=False)
    keep = max(n_tokens, token_counter(tokenizer)(lead))
    return tokenizer.decode(ids[:keep]).strip()


def token_modes(tokenizer: Any, text: str, n_chunks: int) -> list[Mode]:
    """The mode each token of ``text`` is generated in, as a DA session sees it: the
    mode after every earlier token (the first is global)."""
    reader = TagReader(n_chunks)
    modes = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        modes.append(reader.mode)
        reader.feed(tokenizer.decode([tok]))
    return modes


def _render(ids: str, g: str, f: str, loc: str, a: str) -> str:
    return (
        f"<global>{g}</global>\n"
        f'<focus magic_chunks="{ids}">{f}</focus>\n'
        f"<local>{loc}</local>\n"
        f"<answer>{a}</answer>"
    )


def forced_transcript(
    tokenizer: Any, focus: Sequence[int], n_tokens: int, mix: Mix | None = None
) -> str:
    """A complete DA response of about ``n_tokens`` tokens focusing on ``focus``.

    Focus, local and answer sections get their share of ``n_tokens``; the global
    section gets what its share leaves after the tags, which are written in global
    (a tag changes the mode only once it is complete).
    """
    if not focus:
        raise ValueError("focus needs at least one chunk id")
    m = mix or Mix()
    ids = ",".join(str(i) for i in focus)
    f = _section(tokenizer, "Reading the chunk closely. ", round(m.focus * n_tokens), 2)
    loc = _section(tokenizer, "Checking the reasoning. ", round(m.local * n_tokens), 4)
    a = _section(tokenizer, ANSWER + " ", round(m.answer * n_tokens), 3)
    bare = token_modes(tokenizer, _render(ids, "", f, loc, a), max(focus))
    spare = round(m.global_ * n_tokens) - bare.count(Mode.GLOBAL)
    g = _section(tokenizer, "", spare, 0) if spare > 0 else ""
    return _render(ids, g, f, loc, a)


def fact_chunk(chunks: Sequence[Any]) -> int:
    """The id of the chunk whose text holds ``FACT``."""
    for c in chunks:
        if FACT in c.text:
            return int(c.id)
    raise ValueError("the planted fact is in no chunk (was it cut across two?)")
