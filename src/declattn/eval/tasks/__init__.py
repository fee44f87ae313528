"""Seeded task generators: ``generate(name, data, length, seed)`` gives one ``Sample``.

Every generator is a pure function of its name, the token counter (in ``TaskData``),
the length and the seed: the same arguments give the same context, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from declattn.corpora.build import TaskData
from declattn.eval.sample import Sample
from declattn.eval.tasks import agentic, compare, niah, planted, qa, variables, words

__all__ = ["TASKS", "Task", "TaskData", "generate", "resolve_tasks", "turns_of"]


@dataclass(frozen=True)
class Task:
    name: str
    family: str
    make: Callable[[TaskData, int, int], Sample]
    description: str
    turns: int | None = None
    """A conversation of this many turns (one response each), or None: one response."""


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "niah_single_noise",
            "niah",
            niah.single("niah_single_noise", "noise", "number"),
            "one needle (number) in noise",
        ),
        Task(
            "niah_single_essay",
            "niah",
            niah.single("niah_single_essay", "essay", "number"),
            "one needle (number) in essays",
        ),
        Task(
            "niah_single_uuid",
            "niah",
            niah.single("niah_single_uuid", "essay", "uuid"),
            "one needle (UUID) in essays",
        ),
        Task("niah_multikey", "niah", niah.multikey, "one asked needle among other keys'"),
        Task("niah_multivalue", "niah", niah.multivalue, "all values of one key"),
        Task("niah_multiquery", "niah", niah.multiquery, "the values of several keys"),
        Task("vt", "vt", variables.variable_tracking, "variable tracking: a chain of 5"),
        Task("cwe", "aggregation", words.common_words, "the 10 most common words of a list"),
        Task("fwe", "aggregation", words.frequent_words, "the 3 most frequent coded words"),
        Task("qa_squad", "qa", qa.squad, "SQuAD question among distractor paragraphs"),
        Task("qa_hotpot", "qa", qa.hotpot, "HotpotQA two-paragraph question among distractors"),
        Task("twohop", "twohop", compare.compare_two_facts, "compare two facts far apart"),
        Task("planted", "planted", planted.planted, "the main job's invented fact in essays"),
        Task(
            agentic.TASK,
            agentic.FAMILY,
            agentic.agentic,
            f"an agent's transcript of read_file results, {agentic.TURNS} questions in turns",
            turns=agentic.TURNS,
        ),
    )
}

FAMILIES: dict[str, tuple[str, ...]] = {}
for _t in TASKS.values():
    FAMILIES[_t.family] = (*FAMILIES.get(_t.family, ()), _t.name)


def resolve_tasks(spec: str) -> list[str]:
    """Task names from a comma list of task names, family names, or ``all``."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        names = list(TASKS) if part == "all" else FAMILIES.get(part, (part,))
        for name in names:
            if name not in TASKS:
                known = ", ".join([*TASKS, *FAMILIES])
                raise ValueError(f"unknown task {name!r}; known: {known}, all")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError("no task given")
    return out


def turns_of(name: str) -> int | None:
    """The turns of task ``name``'s conversation, or None for a single-response task."""
    return TASKS[name].turns


def generate(name: str, data: TaskData, length: int, seed: int) -> Sample:
    """One sample of task ``name`` at ``length`` tokens, from ``seed``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name].make(data, length, seed)
