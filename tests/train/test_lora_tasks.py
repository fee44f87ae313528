"""Training data for da-lora: drawn from the training part of the corpora only, never a
document (or a paragraph) any evaluation task reads at the evaluation's seeds, and
every target reply is one the engine accepts: its find words resolve to the evidence."""

from __future__ import annotations

import random
import re

import pytest

from declattn.corpora.build import NOISE, TaskData
from declattn.corpora.essays import essays
from declattn.corpora.split import part_of
from declattn.eval.tasks import generate
from declattn.protocol.find import PhraseFinder
from declattn.protocol.segment import segment
from declattn.train.lora_tasks import GENERATORS, Case
from declattn.train.targets import evidence_chunk, reply

STUDY_TASKS = ("planted", "niah_single_essay", "niah_multikey", "qa_squad", "qa_hotpot",
               "twohop", "agentic")
EVAL_SEEDS = range(5)  # `declattn eval`'s default samples: seeds 0..4
_PASSAGE = re.compile(r"^Passage \d+: ")


def words(text: str) -> int:
    """A tokenizer-free token count: the generators only need a consistent one."""
    return len(text.split()) + text.count("\n")


def _paragraphs(text: str) -> set[str]:
    """The document paragraphs of a context: long enough to name a document, not the
    noise filler both sides share."""
    out = set()
    for p in text.split("\n\n"):
        p = _PASSAGE.sub("", p.strip())
        if len(p) >= 120 and not p.startswith(NOISE[:20]):
            out.add(p)
    return out


def _case_texts(case: Case) -> str:
    if case.messages:
        return "\n\n".join(str(m.get("content") or "") for m in case.messages)
    return case.context


@pytest.fixture(scope="module")
def training_cases() -> list[Case]:
    data = TaskData(words, part="train")
    rng = random.Random(11)
    return [gen(data, rng, rng.randint(1000, 3000)) for gen in GENERATORS.values()
            for _ in range(4)]


def test_the_parts_split_every_corpus() -> None:
    train, held = essays("train"), essays("eval")
    assert train and held and not set(train) & set(held)
    assert len(train) + len(held) == len(essays("all"))
    data_t, data_e = TaskData(words, part="train"), TaskData(words, part="eval")
    titles_t = {p["title"] for p in data_t.squad}
    assert titles_t and not titles_t & {p["title"] for p in data_e.squad}
    hot_t = {t for e in data_t.hotpot for t, _ in e["context"]}
    hot_e = {t for e in data_e.hotpot for t, _ in e["context"]}
    assert hot_t and hot_e and not hot_t & hot_e
    assert all(part_of("hotpot", t) == "train" for t in hot_t)


def test_no_training_paragraph_is_in_an_evaluation(training_cases: list[Case]) -> None:
    train = set().union(*(_paragraphs(_case_texts(c)) for c in training_cases))
    data = TaskData(words)  # the evaluation's own (part "eval")
    held: set[str] = set()
    for task in STUDY_TASKS:
        for seed in EVAL_SEEDS:
            held |= _paragraphs(generate(task, data, 4096, seed).context)
    assert len(train) > 200 and len(held) > 200
    assert not train & held
    assert not held & set().union(*(_paragraphs(e) for e in essays("train")))


def test_every_target_resolves_to_its_evidence(training_cases: list[Case]) -> None:
    made = 0
    for case in training_cases:
        if case.messages:
            continue
        chunks = [c.text for c in segment(case.context, words, 120, 160)]
        finder = PhraseFinder(chunks)
        for q in case.questions:
            r = reply(q, chunks, finder)
            if r is None:
                continue
            made += 1
            if not q.hops:
                assert r.startswith("<global>") and r.endswith(f"<answer>{q.answer}</answer>")
                continue
            found = re.findall(r'<focus find="([^"]+)">', r)
            read = set().union(*(finder.resolve(f).ids for f in found))
            need = {evidence_chunk(chunks, h.evidence) for h in q.hops}
            assert need <= read, (q.question, r)
            assert len(found) <= 2 and r.endswith(f"<answer>{q.answer}</answer>")
    assert made >= 20
