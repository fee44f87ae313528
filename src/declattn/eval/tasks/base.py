"""What the evaluation's task generators share beyond the document builders
(``corpora/build.py``): the draw that seeds a sample and builds it, and sizing a context
so the ordinary prompt hits a length."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from declattn.corpora.build import TokenCounter
from declattn.eval.sample import Sample, plain_question

PLAIN_SCAFFOLD = 24
"""Tokens an ordinary chat prompt adds around context and question (system turn, role
headers): subtracted from the requested length so the rendered vanilla prompt lands on it."""


@dataclass(frozen=True)
class Draw:
    """One sample asked of a generator: its task, family, length and seed.

    A sample must regenerate from these four alone, so every generator seeds its
    randomness here and builds its ``Sample`` here, with the four copied in one place.
    """

    task: str
    family: str
    length: int
    seed: int

    def rng(self, stream: str = "") -> random.Random:
        """The sample's seeded randomness; ``stream`` names another, independent one."""
        return random.Random(f"{self.task}/{self.seed}{stream}")

    def sample(
        self,
        context: str,
        question: str,
        answers: Sequence[str],
        evidence: Sequence[tuple[int, int]],
        **rest: Any,
    ) -> Sample:
        """The ``Sample`` of this draw; ``rest`` are its optional fields (scoring, meta...)."""
        return Sample(
            task=self.task, family=self.family, length=self.length, seed=self.seed,
            context=context, question=question, answers=tuple(answers),
            evidence=tuple(evidence), **rest,
        )


def context_target(
    count: TokenCounter, length: int, question: str, answer_format: str = ""
) -> int:
    """Context tokens for a sample whose ordinary prompt should be ``length`` tokens."""
    target = length - count(plain_question(question, answer_format)) - PLAIN_SCAFFOLD
    if target < 64:
        raise ValueError(f"a length of {length} tokens leaves no room for a context")
    return target
