"""One evaluation sample: a context, a question, the expected answers, and where they live.

Where the answer lives is recorded as character spans of the context (the evidence), so
it survives any segmentation; ``evidence_chunks`` turns the spans into magic-chunk ids
once the context has been cut, which is what a focus declaration can be checked against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from declattn.protocol.segment import Chunk

SCORINGS = ("match_all", "qa", "choice")
"""How a response is scored: ``match_all`` (RULER: every expected string in the answer),
``qa`` (exact match and F1 against any gold answer, accuracy when a gold answer appears),
``choice`` (the expected string present and every ``forbidden`` one absent)."""


@dataclass(frozen=True)
class Sample:
    """A generated sample; ``task``, ``length`` and ``seed`` regenerate it exactly.

    ``evidence`` are ``(start, end)`` character spans of ``context`` that hold what the
    answer needs: one per needle, fact, or gold paragraph. Aggregation tasks (common and
    frequent words) have no evidence span: their answer is spread over the whole context.
    """

    task: str
    family: str
    length: int
    seed: int
    context: str
    question: str
    answers: tuple[str, ...]
    evidence: tuple[tuple[int, int], ...]
    scoring: str = "match_all"
    forbidden: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    answer_format: str = ""
    """RULER's answer-format order ("Answer with the number only."), for ordinary prompts.

    A DA prompt does not get it: its instruction orders its own format (tags, then
    ``<answer>``), and small models obey a trailing format order over the instruction,
    writing no tags at all, which would measure the suffix rather than DA."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, not {self.scoring!r}")
        if not self.answers:
            raise ValueError(f"{self.task}: a sample needs at least one expected answer")
        for a, b in self.evidence:
            if not 0 <= a < b <= len(self.context):
                raise ValueError(f"{self.task}: evidence span [{a}, {b}) outside the context")

    def prompt_question(self, da: bool) -> str:
        """The question as an arm asks it: with the answer format unless the prompt is DA."""
        return self.question if da else plain_question(self.question, self.answer_format)

    @property
    def context_sha256(self) -> str:
        """A fingerprint of the context, so a resumed run can tell it regenerated the same one."""
        return hashlib.sha256(self.context.encode("utf-8")).hexdigest()

    def evidence_texts(self) -> list[str]:
        return [self.context[a:b] for a, b in self.evidence]

    def header(self) -> dict[str, Any]:
        """Everything but the context (which the seed regenerates), for the results file."""
        d = asdict(self)
        d.pop("context")
        d["answers"] = list(self.answers)
        d["forbidden"] = list(self.forbidden)
        d["evidence"] = [list(s) for s in self.evidence]
        d["context_chars"] = len(self.context)
        d["context_sha256"] = self.context_sha256
        return d


def plain_question(question: str, answer_format: str) -> str:
    """The question of an ordinary prompt: the question, then its answer-format order."""
    return f"{question} {answer_format}" if answer_format else question


def span_chunks(chunks: Sequence[Chunk], start: int, end: int) -> tuple[int, ...]:
    """Ids of the chunks that overlap the character span ``[start, end)``."""
    return tuple(c.id for c in chunks if c.start < end and start < c.end)


def evidence_chunks(sample: Sample, chunks: Sequence[Chunk]) -> list[tuple[int, ...]]:
    """For each evidence span, the chunk ids holding it (two when it straddles a cut)."""
    return [span_chunks(chunks, a, b) for a, b in sample.evidence]
