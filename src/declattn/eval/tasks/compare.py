"""Two-hop comparison: two facts far apart, and a question that needs both.

"The schooner Wren carried 412 crates ..." near one end of the document and "The
schooner Halcyon carried 287 crates ..." near the other; the question asks which
carried more. Neither fact answers it alone, so a DA response has to focus on two
chunks (in one declaration or two). The facts are invented, so only reading them helps;
the loser's name is ``forbidden`` in the answer, so naming both does not score.
"""

from __future__ import annotations

from dataclasses import dataclass

from declattn.corpora.build import TaskData, haystack
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import Draw, context_target

FAMILY = "twohop"


@dataclass(frozen=True)
class _Kind:
    names: tuple[str, ...]
    fact: str  # with {name} and {n}
    question: str  # with {a} and {b}
    low: int
    high: int
    more_wins: bool


_KINDS = (
    _Kind(
        ("Wren", "Halcyon", "Saltmarsh", "Good Intent", "Northern Star", "Marigold", "Osprey"),
        "On its last voyage the schooner {name} carried {n} crates of lamp oil.",
        "Which schooner carried more crates of lamp oil on its last voyage, the {a} or the {b}?",
        120,
        980,
        True,
    ),
    _Kind(
        ("Alder Hill", "Crow Fell", "Pike Rise", "Harrow Knoll", "Bracken Edge", "Sorrel Top"),
        "The signal tower on {name} is {n} metres tall.",
        "Which signal tower is taller, the one on {a} or the one on {b}?",
        18,
        96,
        True,
    ),
    _Kind(
        ("Linnet Street", "Quarry Lane", "Fenwick Road", "Tanner's Row", "Mill Close"),
        "The lending library on {name} was founded in {n}.",
        "Which lending library was founded earlier, the one on {a} or the one on {b}?",
        1820,
        1990,
        False,
    ),
    _Kind(
        ("Gull Rock", "Tern Point", "Marrowstone", "Skerrow", "Black Ness", "Linnet Isle"),
        "The ferry to {name} makes {n} crossings every week.",
        "Which ferry makes more crossings every week, the one to {a} or the one to {b}?",
        7,
        63,
        True,
    ),
)


def compare_two_facts(data: TaskData, length: int, seed: int) -> Sample:
    draw = Draw("twohop", FAMILY, length, seed)
    rng = draw.rng()
    kind = rng.choice(_KINDS)
    a, b = rng.sample(kind.names, 2)
    na, nb = rng.sample(range(kind.low, kind.high + 1), 2)
    facts = [kind.fact.format(name=a, n=na), kind.fact.format(name=b, n=nb)]
    winner, loser = (a, b) if (na > nb) == kind.more_wins else (b, a)
    first, second = rng.uniform(0.1, 0.35), rng.uniform(0.65, 0.9)
    at = [first, second] if rng.random() < 0.5 else [second, first]
    question, answer_format = kind.question.format(a=a, b=b), "Answer with the name only."
    target = context_target(data.count, length, question, answer_format)
    built = haystack(data, rng, target, facts, at, "essay")
    return draw.sample(
        built.context,
        question,
        [winner],
        built.spans,
        scoring="choice",
        forbidden=(loser,),
        meta={"facts": facts, "values": {a: na, b: nb}},
        answer_format=answer_format,
    )
