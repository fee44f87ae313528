"""What a request gives back: streamed deltas, then the finished answer and its counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from declattn.accounting import saving
from declattn.engine.request import StepRead
from declattn.protocol.tags import Declaration
from declattn.session import Session


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output: text safe to show, and the mode it was written in."""

    text: str
    mode: str
    focus_ids: tuple[int, ...]
    token_index: int
    finish_reason: str | None = None


@dataclass
class Stats:
    """Counts for one response. Attended figures are sums over decode steps."""

    prompt_tokens: int
    output_tokens: int
    decode_steps: int
    prefill_seconds: float
    decode_seconds: float
    logical_attended: int
    physical_attended: int
    vanilla_attended: int
    vanilla_physical: int
    blocks_read: int
    bytes_read: int
    by_mode: dict[str, dict[str, int]]
    cached_tokens: int = 0
    """Prompt tokens the prefix cache supplied (not computed), ``disk_tokens`` of them
    read from its disk tier, the rest from memory."""
    disk_tokens: int = 0

    @property
    def saving(self) -> float:
        """Fraction of vanilla's logical reads avoided."""
        return saving(self.logical_attended, self.vanilla_attended)

    @property
    def physical_saving(self) -> float:
        return saving(self.physical_attended, self.vanilla_physical)


@dataclass
class Answer:
    text: str
    answer: str | None
    arm: str
    finish_reason: str | None
    declarations: list[Declaration]
    declines: list[Declaration]
    stats: Stats
    token_texts: list[str]
    session: Session = field(repr=False)
    reads: list[StepRead] = field(repr=False, default_factory=list)
    note: str | None = None
    """Why the request ran other than as asked (see ``DAOptions.min_context``)."""
