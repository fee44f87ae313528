"""The answer of a DA response: the text of its first accepted ``<answer>`` block.

One definition for every path that reports an answer (the engine's sessions, the vLLM
runner, evaluation rows), so "the model answered X" means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from declattn.protocol.tags import Declaration, TagReader

ANY_CHUNKS = 10_000
"""Chunk count for a reader that only looks for answer tags (focus ids are not judged)."""


def answer_of(text: str, declarations: Sequence[Declaration]) -> str | None:
    """The stripped text of the first accepted ``<answer>`` block of ``text``, up to its
    ``</answer>`` (or the end); ``None`` if the model never opened one."""
    opened = [d for d in declarations if d.kind == "answer" and d.accepted]
    if not opened:
        return None
    start = opened[0].end
    closed = [d for d in declarations if d.kind == "/answer" and d.start >= start]
    end = closed[0].start if closed else len(text)
    return text[start:end].strip()


def answer_text(text: str) -> str | None:
    """``answer_of`` for a finished response given only as text (its tags are read anew)."""
    reader = TagReader(ANY_CHUNKS)
    reader.feed(text)
    reader.finish()
    return answer_of(text, reader.declarations)
