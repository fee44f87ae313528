"""Variable tracking: follow a chain of assignments through noise.

"VAR QXJPT = 48213" starts a chain; "VAR BKWOE = VAR QXJPT" and so on pass the value
along. The question asks for every variable that ends up holding the value: the model
must find each link, which sit at seeded depths far apart. A second chain with another
value is hidden too, so holding the value is not the same as being any variable.
"""

from __future__ import annotations

import random
import string

from declattn.corpora.build import TaskData, depths, haystack
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import Draw, context_target

FAMILY = "vt"
HOPS = 4
"""Assignments after the first in each chain (five variables per chain, as in RULER)."""


def _names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names and name != "VAR":
            names.append(name)
    return names


def _chain(names: list[str], value: str) -> list[str]:
    lines = [f"VAR {names[0]} = {value}."]
    lines += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
    return lines


def variable_tracking(data: TaskData, length: int, seed: int) -> Sample:
    draw = Draw("vt", FAMILY, length, seed)
    rng = draw.rng()
    names = _names(rng, 2 * (HOPS + 1))
    value, other = (str(v) for v in rng.sample(range(10_000, 99_999), 2))
    asked, decoy = names[: HOPS + 1], names[HOPS + 1 :]
    lines = _chain(asked, value) + _chain(decoy, other)
    # Each chain's links keep their order in the text (a later link copies an earlier one).
    at_asked = depths(rng, HOPS + 1)
    at_decoy = depths(rng, HOPS + 1)
    question = (
        f"Find all variables that are assigned the value {value} in the text above, "
        "directly or through other variables. List their names."
    )
    target = context_target(data.count, length, question)
    built = haystack(data, rng, target, lines, at_asked + at_decoy, "noise")
    return draw.sample(
        built.context,
        question,
        asked,
        built.spans[: HOPS + 1],
        forbidden=(),
        meta={"value": value, "decoy_value": other, "decoy": decoy},
    )
