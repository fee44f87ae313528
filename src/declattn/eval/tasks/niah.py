"""Needle in a haystack, in RULER's variants: one needle, several keys, several values,
several queries; noise or essay filler; numbers or UUIDs as values.

A needle is one sentence, "The special magic number for <key> is: <value>.", hidden as
its own unit of filler. Keys are two essay words joined by a hyphen, values seven-digit
numbers or UUIDs, all drawn from the sample's seed.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable

from declattn.corpora.build import TaskData, depths, haystack, pick_words
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import Draw, context_target

FAMILY = "niah"
DISTRACTORS = 3
"""Other keys' needles in multi-key samples, and the number of values or queries in the
multi-value and multi-query samples (RULER uses four needles in all three)."""


def _key(rng: random.Random, data: TaskData) -> str:
    a, b = pick_words(rng, data.words, 2)
    return f"{a}-{b}"


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str, kind: str) -> str:
    noun = "UUID" if kind == "uuid" else "number"
    return f"The special magic {noun} for {key} is: {value}."


def _distinct(n: int, draw: Callable[[], str]) -> list[str]:
    """``n`` distinct draws, in the order drawn (a repeat is drawn again)."""
    out: list[str] = []
    while len(out) < n:
        x = draw()
        if x not in out:
            out.append(x)
    return out


def _unique_keys(rng: random.Random, data: TaskData, n: int) -> list[str]:
    return _distinct(n, lambda: _key(rng, data))


def _unique_values(rng: random.Random, kind: str, n: int) -> list[str]:
    return _distinct(n, lambda: _value(rng, kind))


def _sample(
    draw: Draw,
    data: TaskData,
    *,
    filler: str,
    kind: str,
    keys: list[str],
    values: list[str],
    asked: list[int],
    question: str,
    answer_format: str = "",
) -> Sample:
    """Needles ``keys[i] -> values[i]``; the answer is the values of needles ``asked``."""
    rng = draw.rng("/layout")
    needles = [_needle(k, v, kind) for k, v in zip(keys, values, strict=True)]
    at = depths(rng, len(needles))
    rng.shuffle(at)
    target = context_target(data.count, draw.length, question, answer_format)
    built = haystack(data, rng, target, needles, at, filler)
    return draw.sample(
        built.context,
        question,
        [values[i] for i in asked],
        [built.spans[i] for i in asked],
        meta={"filler": filler, "value_kind": kind, "keys": keys, "values": values},
        answer_format=answer_format,
    )


def _ask_one(key: str, kind: str) -> tuple[str, str]:
    """The question and its answer-format order."""
    noun = "UUID" if kind == "uuid" else "number"
    return (
        f"What is the special magic {noun} for {key} mentioned in the provided text?",
        f"Answer with the {noun} only.",
    )


def _asked(key: str, kind: str) -> dict[str, str]:
    question, answer_format = _ask_one(key, kind)
    return {"question": question, "answer_format": answer_format}


def single(task: str, filler: str, kind: str):
    """A one-needle task over ``filler`` ("noise" or "essay") with ``kind`` values."""

    def generate(data: TaskData, length: int, seed: int) -> Sample:
        draw = Draw(task, FAMILY, length, seed)
        rng = draw.rng()
        key, value = _key(rng, data), _value(rng, kind)
        return _sample(
            draw, data, filler=filler, kind=kind, keys=[key], values=[value], asked=[0],
            **_asked(key, kind),
        )

    return generate


def multikey(data: TaskData, length: int, seed: int) -> Sample:
    """One asked needle among needles of other keys."""
    draw = Draw("niah_multikey", FAMILY, length, seed)
    rng = draw.rng()
    keys = _unique_keys(rng, data, 1 + DISTRACTORS)
    values = _unique_values(rng, "number", len(keys))
    return _sample(
        draw, data, filler="essay", kind="number", keys=keys, values=values, asked=[0],
        **_asked(keys[0], "number"),
    )


def multivalue(data: TaskData, length: int, seed: int) -> Sample:
    """One key with several values, all asked."""
    draw = Draw("niah_multivalue", FAMILY, length, seed)
    rng = draw.rng()
    key = _key(rng, data)
    n = 1 + DISTRACTORS
    values = _unique_values(rng, "number", n)
    question = (
        f"What are all the special magic numbers for {key} mentioned in the provided text? "
        "List every one of them."
    )
    return _sample(
        draw, data, filler="essay", kind="number", keys=[key] * n, values=values,
        asked=list(range(n)), question=question,
    )


def multiquery(data: TaskData, length: int, seed: int) -> Sample:
    """Several keys, each with its value, all asked in one question."""
    draw = Draw("niah_multiquery", FAMILY, length, seed)
    rng = draw.rng()
    keys = _unique_keys(rng, data, 1 + DISTRACTORS)
    values = _unique_values(rng, "number", len(keys))
    question = (
        "What are the special magic numbers for "
        + ", ".join(keys[:-1])
        + f" and {keys[-1]} mentioned in the provided text? List one number per key."
    )
    return _sample(
        draw, data, filler="essay", kind="number", keys=keys, values=values,
        asked=list(range(len(keys))), question=question,
    )
