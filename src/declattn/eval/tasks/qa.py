"""Question answering over SQuAD and HotpotQA with distractor paragraphs.

The gold paragraph (SQuAD) or the supporting paragraphs (HotpotQA, two per question)
sit among distractor paragraphs from other articles, at seeded depths, until the
context reaches its length. Each paragraph is a numbered passage; the numbers follow
the order in the text, so they give nothing away.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from declattn.corpora.build import Built, TaskData, assemble, depths, fit, take_filler
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import Draw, context_target

FAMILY = "qa"
_SEP = "\n\n"
_YES_NO = {"yes", "no"}


def _passage(title: str, text: str) -> str:
    """One passage: its title line, then its text on one line (no blank line inside, so
    blank lines separate passages and nothing else)."""
    return f"{' '.join(title.split())}\n{' '.join(text.split())}"


def _number(built: Built) -> Built:
    """Prefix each passage with ``Passage i:``, shifting the item spans to match."""
    parts = built.context.split(_SEP)
    out: list[str] = []
    shift: list[tuple[int, int]] = []  # (original start of a part, added so far)
    offset, added = 0, 0
    for i, part in enumerate(parts, 1):
        head = f"Passage {i}: "
        shift.append((offset, added + len(head)))
        out.append(head + part)
        offset += len(part) + len(_SEP)
        added += len(head)

    def moved(pos: int) -> int:
        delta = 0
        for start, d in shift:
            if start <= pos:
                delta = d
        return pos + delta

    spans = tuple((moved(a), moved(a) + (b - a)) for a, b in built.spans)
    return Built(_SEP.join(out), spans)


def _with_distractors(
    data: TaskData,
    rng: random.Random,
    target: int,
    golds: list[str],
    distractors: Iterator[str],
) -> Built:
    count = data.count
    sep_tokens = max(0, count("word\n\nword") - 2 * count("word"))
    head_tokens = count("Passage 100: ")
    gold_tokens = sum(count(g) + sep_tokens + head_tokens for g in golds)
    at = depths(rng, len(golds))
    pool = list(_take(distractors, 20000))

    def make(budget: int) -> Built:
        units = iter(pool)
        chosen = take_filler(
            _Headed(count, head_tokens), units, max(0, budget - gold_tokens), sep_tokens
        )
        return _number(assemble(chosen, golds, at, _SEP))

    return fit(count, target, make)


class _Headed:
    """A counter that charges each passage for its ``Passage i:`` header too."""

    def __init__(self, count: Any, head: int) -> None:
        self.count, self.head = count, head

    def __call__(self, text: str) -> int:
        return self.count(text) + self.head


def _take(it: Iterator[str], n: int) -> Iterator[str]:
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def squad(data: TaskData, length: int, seed: int) -> Sample:
    draw = Draw("qa_squad", FAMILY, length, seed)
    rng = draw.rng()
    paras = data.squad
    candidates = [i for i, p in enumerate(paras) if p["qas"]]
    gold_i = rng.choice(candidates)
    gold = paras[gold_i]
    question, answers = rng.choice(gold["qas"])
    gold_text = _passage(gold["title"], gold["context"])

    def distractors() -> Iterator[str]:
        order = [i for i in range(len(paras)) if paras[i]["title"] != gold["title"]]
        rng.shuffle(order)
        for i in order:
            yield _passage(paras[i]["title"], paras[i]["context"])

    answer_format = "Answer with a short phrase from the passages."
    target = context_target(data.count, length, question, answer_format)
    built = _with_distractors(data, rng, target, [gold_text], distractors())
    return draw.sample(
        built.context,
        question,
        answers,
        built.spans,
        scoring="qa",
        meta={"title": gold["title"]},
        answer_format=answer_format,
    )


def _hotpot_paragraph(entry: dict[str, Any], title: str) -> str:
    for t, sentences in entry["context"]:
        if t == title:
            return _passage(t, "".join(sentences))
    raise KeyError(title)


def hotpot(data: TaskData, length: int, seed: int) -> Sample:
    draw = Draw("qa_hotpot", FAMILY, length, seed)
    rng = draw.rng()
    entries = data.hotpot
    while True:
        entry = entries[rng.randrange(len(entries))]
        gold_titles = list(dict.fromkeys(t for t, _ in entry["supporting_facts"]))
        if entry["answer"].strip().lower() not in _YES_NO and len(gold_titles) == 2:
            break
    golds = [_hotpot_paragraph(entry, t) for t in gold_titles]
    own = [_passage(t, "".join(s)) for t, s in entry["context"] if t not in gold_titles]

    def distractors() -> Iterator[str]:
        yield from own  # the question's own distractors first: the hard ones
        while True:
            other = entries[rng.randrange(len(entries))]
            if other is entry:
                continue
            for t, s in other["context"]:
                if t not in gold_titles:
                    yield _passage(t, "".join(s))

    answer_format = "Answer with a short phrase."
    target = context_target(data.count, length, entry["question"], answer_format)
    built = _with_distractors(data, rng, target, golds, distractors())
    return draw.sample(
        built.context,
        entry["question"],
        [entry["answer"].strip()],
        built.spans,
        scoring="qa",
        meta={"id": entry["_id"], "titles": gold_titles},
        answer_format=answer_format,
    )
