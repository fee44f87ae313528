"""Is a response right? RULER's string match, SQuAD's exact match and F1, and the
choice rule of the two-hop task; all from the answer text and the sample's header.

A response with no answer at all (a DA arm that never wrote ``<answer>``) scores zero
on every measure: a format failure is a wrong answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    p = normalize(prediction)
    return float(any(p == normalize(g) for g in golds))


def f1(prediction: str, golds: Sequence[str]) -> float:
    """Token-overlap F1, the best over the gold answers."""
    pred = normalize(prediction).split()
    best = 0.0
    for gold in golds:
        g = normalize(gold).split()
        common = sum((Counter(pred) & Counter(g)).values())
        if not common:
            continue
        precision, recall = common / len(pred), common / len(g)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains(prediction: str, expected: str) -> bool:
    """RULER's test: the expected string appears in the prediction, case-insensitively."""
    return expected.lower() in prediction.lower()


def match_all(prediction: str, expected: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of expected strings present."""
    return sum(contains(prediction, e) for e in expected) / len(expected)


def match_part(prediction: str, expected: Sequence[str]) -> float:
    """RULER's ``string_match_part`` (its QA score): 1 if any expected string is present."""
    return float(any(contains(prediction, e) for e in expected))


@dataclass(frozen=True)
class Score:
    """``accuracy`` is the headline figure for every task; the rest are task-specific."""

    accuracy: float
    all_present: bool
    format_failure: bool
    exact_match: float | None = None
    f1: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score(prediction: str | None, header: dict[str, Any]) -> Score:
    """Score ``prediction`` (``None``: no answer was given) against a sample header.

    ``match_all`` tasks: RULER's fraction of expected strings present. ``qa``: RULER's
    part match (a gold answer appears), with SQuAD EM and F1 beside it. ``choice``: 1
    when the expected name is present and no forbidden one is.
    """
    answers = list(header["answers"])
    scoring = header.get("scoring", "match_all")
    if prediction is None or not prediction.strip():
        zero = 0.0 if scoring == "qa" else None
        return Score(0.0, False, prediction is None, zero, zero)
    if scoring == "qa":
        acc = match_part(prediction, answers)
        return Score(
            acc, acc == 1.0, False, exact_match(prediction, answers), f1(prediction, answers)
        )
    if scoring == "choice":
        hit = all(contains(prediction, a) for a in answers) and not any(
            contains(prediction, f) for f in header.get("forbidden", ())
        )
        return Score(float(hit), hit, False)
    acc = match_all(prediction, answers)
    return Score(acc, acc == 1.0, False)
