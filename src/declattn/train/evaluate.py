"""Held-out evaluation of a model trained to declare, decoded by the real engine.

Every sample is a fresh document from ``tasks.make_episode`` with a seed the training
never drew (training uses its own RNG stream from ``TinySpec.seed``; evaluation seeds
are offset by ``EVAL_SEED_BASE``). Arms, all on the same documents in one engine:

- ``da``: DA masking from the model's own tags;
- ``da-nm``: the same prompt, no masking (the vanilla arm of a DA-trained model: it has
  only ever seen DA prompts);
- ``wrong``: the engine overrides every focus declaration with a chunk that holds none
  of the evidence. Accuracy should collapse, which shows the answer really comes from
  what the focus step reads and not from something global steps left behind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from declattn.api.session import DASession
from declattn.da.scope import Scope
from declattn.engine.sampler import SamplingParams
from declattn.protocol.modes import Mode
from declattn.train.tasks import Episode, make_episode, wrong_chunk

if TYPE_CHECKING:
    from declattn.api import Engine

EVAL_SEED_BASE = 1_000_003
ARMS = ("da", "da-nm", "wrong")
MAX_TOKENS = 64


class WrongFocus(DASession):
    """A DA session whose focus steps read a chunk without the evidence."""

    def __init__(self, *args: Any, wrong: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wrong = wrong

    def scope(self) -> Scope:
        scope = super().scope()
        if scope.mode is Mode.FOCUS:
            return Scope(self.layout, Mode.FOCUS, (self.wrong,))
        return scope


@dataclass(frozen=True)
class Cell:
    """One row of the table: a task shape under one arm."""

    n_chunks: int
    two_hop: bool
    arm: str
    samples: int
    correct: int
    focus_ok: int  # responses whose focus declarations named exactly the evidence chunks
    declines: int
    attended: float  # attended / vanilla tokens over all decode steps (logical)
    physical: float  # the same in whole KV blocks

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples

    @property
    def task(self) -> str:
        return f"{'2' if self.two_hop else '1'}-hop, {self.n_chunks} chunks"


def episodes(n_chunks: int, two_hop: bool, samples: int, seed: int) -> list[Episode]:
    rng = random.Random(EVAL_SEED_BASE + seed * 7919 + n_chunks * 2 + two_hop)
    return [make_episode(rng, n_chunks, two_hop) for _ in range(samples)]


def _session(engine: Engine, episode: Episode, arm: str, rng: random.Random) -> DASession:
    from dataclasses import replace

    options = replace(engine.da_defaults, masking=arm != "da-nm", constrain=False)
    args = (engine.tokenizer, episode.context, episode.question, options, engine.block_size)
    if arm == "wrong":
        n = len(episode.paragraphs)
        return WrongFocus(*args, max_tokens=MAX_TOKENS, wrong=wrong_chunk(episode, rng, n))
    return DASession(*args, max_tokens=MAX_TOKENS)


def run_cell(
    engine: Engine, n_chunks: int, two_hop: bool, arm: str, samples: int, seed: int = 0,
    batch: int = 64,
) -> Cell:
    """Greedy answers to ``samples`` fresh documents, decoded in batches by the engine
    (at most ``batch`` at once, and no more than its KV pool holds)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    eps = episodes(n_chunks, two_hop, samples, seed)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    sessions = [(e, _session(engine, e, arm, rng)) for e in eps]
    longest = max(len(s.prompt_ids) for _, s in sessions) + MAX_TOKENS
    fits = engine.pool.free // -(-longest // engine.block_size)
    step = max(1, min(batch, fits))
    for start in range(0, len(sessions), step):
        seqs = [engine.add(s, params) for _, s in sessions[start : start + step]]
        while any(q.finish_reason is None for q in seqs):
            engine.step()
    return _score(n_chunks, two_hop, arm, sessions)


def _score(n_chunks: int, two_hop: bool, arm: str, sessions: list) -> Cell:
    correct = focus_ok = declines = 0
    att = van = phys = vphys = 0
    for episode, s in sessions:
        correct += s.answer == episode.answer
        named = [d.focus_ids for d in s.declarations if d.kind == "focus" and d.accepted]
        focus_ok += named == [(c,) for c in episode.evidence_chunks]
        declines += len(s.declines)
        t = s.accounting.totals()
        att, van = att + t["logical"], van + t["vanilla_logical"]
        phys, vphys = phys + t["physical"], vphys + t["vanilla_physical"]
    return Cell(
        n_chunks, two_hop, arm, len(sessions), correct, focus_ok, declines,
        att / max(1, van), phys / max(1, vphys),
    )


DEFAULT_GRID: tuple[tuple[int, bool, str], ...] = (
    (16, False, "da"),
    (16, False, "da-nm"),
    (16, False, "wrong"),
    (16, True, "da"),
    (16, True, "da-nm"),
    (32, False, "da"),
    (64, False, "da"),
)
