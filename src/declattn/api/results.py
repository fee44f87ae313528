"""What a request gives back: streamed deltas, then the finished answer and its counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from declattn.api.session import Session
from declattn.da.accounting import saving
from declattn.engine.request import StepRead
from declattn.protocol.tags import Declaration


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
    """Counts for one response. ``decode_steps`` counts forwards (a run of forced tag
    text goes in one); attended figures are sums over every token's query."""

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


@dataclass(frozen=True)
class PerAnswer:
    """What a whole DA reply cost against the plain reply to the same question: each
    figure is DA over plain. This is the saving a user pays for (per answer); the saving
    per step (``Stats.saving``) compares a DA reply with the same reply read in full.

    ``forwards`` counts model calls (a forced run of tag text is one), ``tokens`` the
    reply's tokens, ``attended`` the KV positions read summed over every token's query,
    ``kv_bytes`` the KV bytes gathered, ``seconds`` the decode time."""

    tokens: float
    forwards: float
    attended: float
    kv_bytes: float
    seconds: float

    @classmethod
    def of(cls, da: Stats, plain: Stats) -> PerAnswer:
        def ratio(a: float, b: float) -> float:
            return a / b if b else float("inf") if a else 1.0

        return cls(
            tokens=ratio(da.output_tokens, plain.output_tokens),
            forwards=ratio(da.decode_steps, plain.decode_steps),
            attended=ratio(da.logical_attended, plain.logical_attended),
            kv_bytes=ratio(da.bytes_read, plain.bytes_read),
            seconds=ratio(da.decode_seconds, plain.decode_seconds),
        )

    def verdict(self) -> str:
        """One line: which reply was cheaper, in reads and in decode time."""
        reads = "fewer" if self.attended < 1 else "more"
        time = "less" if self.seconds < 1 else "more"
        return (f"per answer, DA read {self.attended:.2f}x the plain answer's attended tokens "
                f"({reads}) and took {self.seconds:.2f}x its decode time ({time})")
