"""The reply a declaring model should write, by a program that knows where the evidence is.

The economical protocol (issue 40), on the chunks the segmenter cut:

- one fact: ``<focus find="WORDS"><answer>X</answer>``;
- two hops: ``<focus find="A">QUOTE</focus><focus find="B"><answer>X</answer>``;
- a survey of the whole document: ``<global>NOTES</global><answer>X</answer>``.

WORDS are written while the model reads only the question and its reply (a scaffold
step reads local), so they are copied from the question (for the second hop, from the
quote or the question): the longest phrase of two to six words, not starting or ending
with a function word, that ``PhraseFinder`` resolves, as an exact phrase, to the
evidence's chunk, alone if any such phrase does, else among at most three. A question
with no such phrase is not asked: a target the engine would decline teaches nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from declattn.protocol.find import MatchQuality, PhraseFinder, phrase_words
from declattn.train.lora_tasks import Question

MIN_WORDS, MAX_WORDS = 2, 6
EDGE_WORDS = frozenset(
    "a an the of to in on at by for from with and or but is are was were be been do does "
    "did what which who whom whose when where why how that this these those it its as into "
    "than then there their his her he she they them was has have had many much".split()
)
_TRIM = re.compile(r"^[^\w]+|[^\w]+$")


def _tokens(text: str) -> list[str]:
    """Whitespace words of ``text`` with punctuation trimmed at their edges."""
    out = []
    for raw in text.split():
        w = _TRIM.sub("", raw)
        if w:
            out.append(w)
    return out


def find_words(source: str, finder: PhraseFinder, need: Sequence[int]) -> str | None:
    """The phrase of ``source`` to write in ``<focus find="...">`` to read the chunks
    ``need``: one that resolves to exactly them if any does, else to at most three
    chunks among which they are."""
    tokens = _tokens(source)
    best: tuple[tuple[int, int, int], str] | None = None
    for start in range(len(tokens)):
        for stop in range(start + 1, min(len(tokens), start + MAX_WORDS) + 1):
            words = tokens[start:stop]
            if words[0].lower() in EDGE_WORDS or words[-1].lower() in EDGE_WORDS:
                continue
            phrase = " ".join(words)
            n = len(phrase_words(phrase))
            if not MIN_WORDS <= n <= MAX_WORDS or any(c in phrase for c in "\"<>"):
                continue
            r = finder.resolve(phrase)
            if not r.accepted or r.quality is not MatchQuality.EXACT or \
                    not set(need) <= set(r.ids):
                continue
            score = (int(set(r.ids) == set(need)), n, -start)
            if best is None or score > best[0]:
                best = (score, phrase)
    return None if best is None else best[1]


def evidence_chunk(chunk_texts: Sequence[str], evidence: str) -> int | None:
    """The one chunk (1-based) whose text holds ``evidence`` whole; ``None`` if the
    evidence straddles a boundary or occurs in several chunks."""
    found = [i for i, t in enumerate(chunk_texts, 1) if evidence in t]
    return found[0] if len(found) == 1 else None


def reply(q: Question, chunk_texts: Sequence[str], finder: PhraseFinder) -> str | None:
    """The target reply to ``q`` over these chunks, or ``None`` where none can be made."""
    if not q.hops:
        return f"<global>{q.notes}</global><answer>{q.answer}</answer>"
    chunks = [evidence_chunk(chunk_texts, h.evidence) for h in q.hops]
    if any(c is None for c in chunks):
        return None
    if len(q.hops) == 1:
        (c,) = chunks
        words = find_words(q.question, finder, [c])  # type: ignore[list-item]
        if words is None or q.answer not in chunk_texts[c - 1]:  # type: ignore[operator]
            return None
        return f'<focus find="{words}"><answer>{q.answer}</answer>'
    (c1, c2), quote = chunks, q.hops[0].quote
    if c1 == c2:
        return None
    both = find_words(q.question, finder, [c1, c2])  # type: ignore[list-item]
    if both is not None and len(finder.resolve(both).ids) == 2:
        # one phrase of the question names both facts' chunks: one focus reads both
        return f'<focus find="{both}"><answer>{q.answer}</answer>'
    first = find_words(q.question, finder, [c1])  # type: ignore[list-item]
    second = (find_words(quote, finder, [c2])  # type: ignore[list-item]
              or find_words(q.question, finder, [c2]))  # type: ignore[list-item]
    if first is None or second is None:
        return None
    return (f'<focus find="{first}">{quote}</focus>'
            f'<focus find="{second}"><answer>{q.answer}</answer>')
