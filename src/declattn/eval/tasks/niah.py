"""Needle in a haystack, in RULER's variants: one needle, several keys, several values,
several queries; noise or essay filler; numbers or UUIDs as values.

A needle is one sentence, "The special magic number for <key> is: <value>.", hidden as
its own unit of filler. Keys are two essay words joined by a hyphen, values seven-digit
numbers or UUIDs, all drawn from the sample's seed.
"""

from __future__ import annotations

import random
import uuid

from declattn.corpora.build import TaskData, depths, haystack, pick_words
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import context_target

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


def _unique_keys(rng: random.Random, data: TaskData, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        k = _key(rng, data)
        if k not in keys:
            keys.append(k)
    return keys


def _unique_values(rng: random.Random, kind: str, n: int) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        v = _value(rng, kind)
        if v not in values:
            values.append(v)
    return values


def _sample(
    task: str,
    data: TaskData,
    length: int,
    seed: int,
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
    rng = random.Random(f"{task}/{seed}/layout")
    needles = [_needle(k, v, kind) for k, v in zip(keys, values, strict=True)]
    at = depths(rng, len(needles))
    rng.shuffle(at)
    target = context_target(data.count, length, question, answer_format)
    built = haystack(data, rng, target, needles, at, filler)
    return Sample(
        task=task,
        family=FAMILY,
        length=length,
        seed=seed,
        context=built.context,
        question=question,
        answers=tuple(values[i] for i in asked),
        evidence=tuple(built.spans[i] for i in asked),
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
        rng = random.Random(f"{task}/{seed}")
        key, value = _key(rng, data), _value(rng, kind)
        return _sample(
            task,
            data,
            length,
            seed,
            filler=filler,
            kind=kind,
            keys=[key],
            values=[value],
            asked=[0],
            **_asked(key, kind),
        )

    return generate


def multikey(data: TaskData, length: int, seed: int) -> Sample:
    """One asked needle among needles of other keys."""
    task = "niah_multikey"
    rng = random.Random(f"{task}/{seed}")
    keys = _unique_keys(rng, data, 1 + DISTRACTORS)
    values = _unique_values(rng, "number", len(keys))
    return _sample(
        task,
        data,
        length,
        seed,
        filler="essay",
        kind="number",
        keys=keys,
        values=values,
        asked=[0],
        **_asked(keys[0], "number"),
    )


def multivalue(data: TaskData, length: int, seed: int) -> Sample:
    """One key with several values, all asked."""
    task = "niah_multivalue"
    rng = random.Random(f"{task}/{seed}")
    key = _key(rng, data)
    n = 1 + DISTRACTORS
    values = _unique_values(rng, "number", n)
    question = (
        f"What are all the special magic numbers for {key} mentioned in the provided text? "
        "List every one of them."
    )
    return _sample(
        task,
        data,
        length,
        seed,
        filler="essay",
        kind="number",
        keys=[key] * n,
        values=values,
        asked=list(range(n)),
        question=question,
    )


def multiquery(data: TaskData, length: int, seed: int) -> Sample:
    """Several keys, each with its value, all asked in one question."""
    task = "niah_multiquery"
    rng = random.Random(f"{task}/{seed}")
    keys = _unique_keys(rng, data, 1 + DISTRACTORS)
    values = _unique_values(rng, "number", len(keys))
    question = (
        "What are the special magic numbers for "
        + ", ".join(keys[:-1])
        + f" and {keys[-1]} mentioned in the provided text? List one number per key."
    )
    return _sample(
        task,
        data,
        length,
        seed,
        filler="essay",
        kind="number",
        keys=keys,
        values=values,
        asked=list(range(len(keys))),
        question=question,
    )
