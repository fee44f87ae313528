"""The forced-wrong-chunk control: a DA session whose every focused read goes to a chunk
that holds none of the sample's evidence.

Whatever the model declares, the steps that would read its focus (the focus block, and
an answer written inside it) read the wrong chunk instead; every other step reads what
the protocol says. If the answers still come out right, they did not come from the
focused chunk (but from the question, earlier steps, or the model's memory); a model
that really answers from what it focused on collapses here (da-tiny: 97.5% -> 3%).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from declattn.api.session import DASession
from declattn.da.scope import Scope
from declattn.eval.sample import span_chunks


class NoControl(ValueError):
    """The sample has no chunk to force: its evidence is nowhere, or everywhere."""


class WrongFocusSession(DASession):
    """``DASession`` with focused reads moved to ``wrong``, a chunk without evidence."""

    arm = "da-model-wrong"

    def __init__(self, *args: Any, evidence: Sequence[tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        held = {i for a, b in evidence for i in span_chunks(self.chunks, a, b)}
        others = [c.id for c in self.chunks if c.id not in held]
        if not held or not others:
            raise NoControl("the forced-wrong-chunk control needs evidence in some chunks and "
                            "none in another")
        question = str(args[2]) if len(args) > 2 else ""
        self.wrong = random.Random(question).choice(others)

    def scope(self) -> Scope:
        scope = super().scope()
        if scope.focus_ids:  # a focus, or an answer inside one
            return Scope(self.layout, scope.mode, (self.wrong,))
        return scope
