"""One sequence inside the engine, from admission to its finish, and what its steps read.

A ``Request`` is the engine's own state for a sequence: prompt, sampled tokens, where
its prefill stands, and a ``StepRead`` per decode step (what attention really gathered,
as the read counter saw it). The layer above keeps its decisions in the ``Controller``
it supplied; this holds only what the engine did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from declattn.engine.controller import Controller
from declattn.engine.detok import Detokenizer
from declattn.engine.sampler import SamplingParams


@dataclass(frozen=True)
class StepRead:
    """What one decode row of one sequence actually read from the KV pools: one per
    decode step, or one per row of a forward that carries forced tokens.

    ``forced``: the row's input is a forced token (its output was not sampled either,
    but for the last row of a forward), or the row rode the forward that completed the
    prompt; a decode forward of ``1 + k`` rows holds ``k`` forced ones, so the rows of a
    reply are ``len(reads)`` and its decode forwards the reads that are not forced. The
    K/V bytes the rows of one forward read together count once, on its first row
    (``global_bytes``/``sliding_bytes``); ``blocks`` is each row's own view."""

    index: int
    length: int
    blocks: tuple[int, ...]
    layers_agree: bool
    global_bytes: int
    sliding_bytes: int
    seconds: float
    forced: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one sequence; ``finish_reason`` is set on its last."""

    seq_id: int
    token_id: int
    text: str
    index: int
    finish_reason: str | None


@dataclass(eq=False)
class Request:
    """A sequence the engine generates for; ``controller`` decides for it."""

    seq_id: int
    params: SamplingParams
    controller: Controller
    detok: Detokenizer
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    reads: list[StepRead] = field(default_factory=list)
    held: str = ""
    prefilled: int = 0
    cached_tokens: int = 0
    """Prompt positions taken over from the prefix cache (not computed): from memory or,
    ``disk_tokens`` of them, read from its disk tier."""
    disk_tokens: int = 0
    """Prompt positions of ``cached_tokens`` read from the prefix cache's disk tier."""
    digests: list[bytes] = field(default_factory=list, repr=False)
    """Content addresses of the prompt's full blocks (prefix caching)."""
    registered: int = 0
    """Prompt positions whose blocks are addressed in the cache."""
    preemptions: int = 0
    """Times the engine gave this sequence's blocks to others and recomputed them."""
    finish_reason: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    """Wall seconds of the forwards that ran this sequence's prompt rows / decode rows,
    each with the time its controller and the sampler took over the token they gave
    (constraints, the DA state, forced text): what a user waits for."""
    opening: tuple[int, ...] = ()
    """Tokens the controller fixed at admission (``Acceptor.opening``), accepted by the
    step that completes the prompt, which runs their rows with its piece."""
    pending_views: list[tuple[int, ...] | None] = field(default_factory=list, repr=False)
    """Views already asked for the rows before the newest token that are not in the KV
    cache yet (forced tokens: see ``Controller.forced``); the next forward runs them."""

    @property
    def kv_length(self) -> int:
        """Positions a decoding sequence holds in the KV cache: its prompt and every row
        a forward ran (the newest token, and forced ones, wait for the next)."""
        return len(self.prompt_ids) + len(self.reads)

    @property
    def prompt_ids(self) -> list[int]:
        return self.controller.prompt_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.token_texts)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output: every position the sequence holds."""
        return [*self.prompt_ids, *self.output_ids]
