"""Replay a finished response: per-step mode and attended tokens, without a model.

Replay uses the engine's one-step semantics, so its figures match a live run on the
same transcript: output token 0 comes from prefill (full attention, no decode step);
decode step ``k`` (``k >= 1``) produces output token ``k``, its query sits at position
``prompt_len + k - 1``, it sees ``prompt_len + k`` positions, and it reads under the
reader's state after tokens ``0..k-1``. A tag therefore takes effect at the token
after the one that completes it (the one-step lag).

A find focus is resolved again from the chunk texts (the run record keeps them): the
resolution is a pure function of the phrase and those texts, so a replay names the same
chunks the live run did. Without ``chunk_texts`` every find is declined, as it is by any
reader that has no texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from declattn.da.accounting import Accounting, StepRecord
from declattn.da.scope import DEFAULT_BLOCK_SIZE
from declattn.da.state import DAState
from declattn.protocol.layout import Layout
from declattn.protocol.modes import Mode
from declattn.protocol.tags import Declaration

__all__ = ["Replay", "StepRecord", "replay"]


@dataclass
class Replay:
    """Per-step records and the declarations of one replayed response."""

    steps: list[StepRecord]
    declarations: list[Declaration]
    block_size: int = DEFAULT_BLOCK_SIZE

    def accounting(self) -> Accounting:
        """The steps summed by the same accumulator a live session uses."""
        acc = Accounting()
        for s in self.steps:
            acc.add(s)
        return acc

    def totals(self) -> dict[str, Any]:
        return self.accounting().totals()

    def by_mode(self) -> dict[Mode, dict[str, int]]:
        return self.accounting().by_mode()

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "steps": [s.to_dict() for s in self.steps],
            "declarations": [d.to_dict() for d in self.declarations],
            "totals": self.totals(),
            "by_mode": {str(m): v for m, v in self.by_mode().items()},
        }


def replay(
    layout: Layout,
    token_texts: Sequence[str],
    block_size: int = DEFAULT_BLOCK_SIZE,
    line_start: bool = False,
    chunk_texts: Sequence[str] | None = None,
    scaffold_local: bool = False,
) -> Replay:
    """Replay the output tokens ``token_texts`` of a response to ``layout``'s prompt.

    ``chunk_texts`` (one per chunk of ``layout``, in order) lets find declarations
    resolve as they did live; ``line_start`` and ``scaffold_local`` are the request's
    own settings (``DAOptions``). The state is the live session's own ``DAState``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    state = DAState(layout, chunk_texts, line_start=line_start, scaffold_local=scaffold_local)
    steps: list[StepRecord] = []
    for k, text in enumerate(token_texts):
        if k >= 1:
            length = layout.prompt_len + k
            scope = state.scope()
            count = scope.count(length, block_size)
            steps.append(StepRecord.from_count(k, scope.mode, scope.focus_ids, length, count))
        state.feed(-1, text)
    state.finish()
    return Replay(steps=steps, declarations=list(state.declarations), block_size=block_size)
