"""The arms of an evaluation, all run by the same engine on the same sample.

- ``vanilla``: the ordinary prompt (context and question in one user turn), full reads;
- ``da-nm``: the DA prompt, tags read but nothing masked (what the prompt alone does);
- ``da``: DA with masking, no decoding constraint;
- ``da-constrained``: DA with masking and the focus-declaration constraint;
- ``da-find``: DA taught ``<focus find="WORDS">`` (the engine looks the words up);
- ``da-find-constrained``: the same, the phrase constrained to text the chunks hold;
- ``da-find-index``: ``da-find`` with an in-context index of the chunks;
- ``da-economy``: the economical protocol (``DAOptions.economy``: a find focus with the
  answer written inside it, scaffold steps read as local, forced tag text in one forward);
- ``vanilla-chunks``: the plain answer over the DA prompt's own chunk transcript
  (``PlainSession.over_chunks``): the same document turns as the DA arms, a final turn
  asking for a plain answer; full reads. What ``declattn demo`` and ``run --compare``
  put a DA reply against;
- ``streaming``: StreamingLLM on the ordinary prompt, at DA's mean blocks per step (or
  another DA arm's: ``ArmSettings.budget_arm``);
- ``quest``: Quest-style top-k blocks on the ordinary prompt, at the same budget;
- ``da-model``: DA with the model's own settings (its ``declattn.json``: a model trained
  to declare, as ``declattn run --model`` serves it); ``da-model-wrong``: the same with
  every focused read moved to a chunk without the evidence (``controls.py``).

The sparse arms take their budget from the ``da`` arm of the same sample, so ``da``
runs first. ``ORDER`` also groups the arms by prompt: the DA arms and ``vanilla-chunks``
share the chunk transcript, ``vanilla`` and the sparse arms the ordinary prompt; the
engine's prefix cache then gives every arm after the first of its group its prompt's K/V
without prefilling it again (bit for bit what a fresh prefill computes), while the
previous group's blocks are evicted as the pool needs room.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from declattn.api.session import Session
from declattn.da.options import DAOptions
from declattn.engine.request import Request
from declattn.engine.sampler import SamplingParams
from declattn.eval.baselines import QuestSession, StreamingSession, sink_blocks
from declattn.eval.controls import WrongFocusSession
from declattn.protocol.prompt import render_plain

if TYPE_CHECKING:
    from declattn.api import Engine

ARMS = (
    "vanilla", "vanilla-chunks", "da-nm", "da", "da-constrained", "da-find",
    "da-find-constrained", "da-find-index", "da-economy", "streaming", "quest",
    "da-model", "da-model-wrong",
)
ORDER = (
    "da-model", "da-model-wrong", "da", "da-nm", "da-constrained", "da-find",
    "da-find-constrained", "da-find-index", "da-economy", "vanilla-chunks", "vanilla",
    "streaming", "quest",
)
DA_ARMS = (
    "da-nm", "da", "da-constrained", "da-find", "da-find-constrained", "da-find-index",
    "da-economy", "da-model", "da-model-wrong",
)
MODEL_ARMS = ("da-model", "da-model-wrong")
SPARSE_ARMS = ("streaming", "quest")
INDEX_TOKENS = 256
"""The in-context index's budget in the ``da-find-index`` arm (one line per chunk)."""


def parse_arms(spec: str, budget_arm: str = "da") -> list[str]:
    """Arm names from a comma list (or ``all``), in run order; sparse arms need the arm
    they take their budget from (``budget_arm``)."""
    every = [a for a in ARMS if a not in MODEL_ARMS]  # "all": the arms any model runs
    names = every if spec.strip() == "all" else [a.strip() for a in spec.split(",") if a]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}, all")
    if not names:
        raise ValueError("no arm given")
    if budget_arm not in DA_ARMS:
        raise ValueError(f"the budget arm must be a DA arm ({', '.join(DA_ARMS)})")
    if any(a in SPARSE_ARMS for a in names) and budget_arm not in names:
        raise ValueError(
            f"the streaming and quest arms take their budget from the {budget_arm} arm: "
            f"add {budget_arm}"
        )
    return [a for a in ORDER if a in names]


@dataclass(frozen=True)
class ArmSettings:
    """What every arm of a run shares."""

    max_tokens: int = 192
    chunk_target: int = 2048
    chunk_cap: int = 2560
    sink: int = 16
    budget_arm: str = "da"

    def da_options(self, arm: str) -> DAOptions:
        """The DA options of ``arm`` (a DA arm; ``vanilla-chunks`` reads the chunking of
        ``da``), over this run's chunk sizes and sink."""
        if arm == "da-economy":
            return DAOptions.economy(
                target=self.chunk_target, cap=self.chunk_cap, sink=self.sink, min_context=0
            )
        return DAOptions(
            target=self.chunk_target,
            cap=self.chunk_cap,
            sink=self.sink,
            masking=arm != "da-nm",
            constrain=arm.endswith("-constrained"),
            focus="find" if arm.startswith("da-find") else "ids",
            index=INDEX_TOKENS if arm == "da-find-index" else 0,
            min_context=0,  # an evaluation measures DA wherever asked, the break-even too
        )


def budget_from_da(da_row: dict[str, Any], sink: int) -> tuple[int, float]:
    """The sparse arms' blocks per step: DA's mean physical blocks per decode step,
    rounded, and never fewer than the sink's blocks plus two (one chosen, the newest)."""
    totals, bs = da_row["totals"], da_row["block_size"]
    steps = totals["steps"]
    mean = totals["physical"] / bs / steps if steps else 0.0
    return max(sink_blocks(sink, bs) + 2, round(mean)), mean


@dataclass
class ArmRun:
    """One finished response: its session (prompt, text, accounting) and its sequence."""

    arm: str
    session: Session
    seq: Request
    wall_seconds: float
    budget: int | None = None
    kv_dtype: str | None = None


class ArmRunner:
    """Runs arms on one engine; arms that read the same prompt share its prefill through
    the engine's prefix cache."""

    def __init__(self, engine: Engine, settings: ArmSettings) -> None:
        self.engine = engine
        self.settings = settings

    def options(self, arm: str) -> DAOptions:
        """A DA arm's settings: the model's own for the model arms, else the run's."""
        if arm in MODEL_ARMS:
            return replace(self.engine.da_options(), min_context=0)
        return self.settings.da_options(arm)

    def session(
        self, arm: str, context: str, question: str, budget: int | None,
        evidence: Sequence[tuple[int, int]] = (),
    ) -> Session:
        e, s = self.engine, self.settings
        if arm == "da-model-wrong":
            return WrongFocusSession(
                e.tokenizer, context, question, self.options(arm), e.block_size,
                max_tokens=s.max_tokens, evidence=evidence,
            )
        if arm in DA_ARMS:
            return e.session(
                context, question, da=True, options=self.options(arm), max_tokens=s.max_tokens
            )
        if arm == "vanilla":
            return e.session(context, question, da=False)
        if arm == "vanilla-chunks":
            return e.session(
                context, question, da=False, options=s.da_options("da"), shared_prefix=True
            )
        if budget is None:
            raise ValueError(f"the {arm} arm needs a budget (from the da arm)")
        cls = StreamingSession if arm == "streaming" else QuestSession
        ids = render_plain(e.tokenizer, context, question)
        return cls(ids, e.block_size, budget, s.sink)

    def prompt_fits(self, n_prompt: int) -> bool:
        return n_prompt + self.settings.max_tokens <= self.engine.max_positions

    def run(
        self, arm: str, context: str, question: str, budget: int | None = None,
        evidence: Sequence[tuple[int, int]] = (),
    ) -> ArmRun:
        return self.execute(arm, self.session(arm, context, question, budget, evidence), budget)

    def execute(self, arm: str, sess: Session, budget: int | None = None) -> ArmRun:
        """Run ``sess`` to its end and time it (a conversation's turn builds its own)."""
        if not self.prompt_fits(len(sess.prompt_ids)):
            raise PromptTooLong(
                f"prompt of {len(sess.prompt_ids)} tokens + max_tokens "
                f"{self.settings.max_tokens} exceeds the model's {self.engine.max_positions} "
                "positions",
                len(sess.prompt_ids),
            )
        params = SamplingParams(max_tokens=self.settings.max_tokens)
        t0 = time.perf_counter()
        seq = self.engine.add(sess, params)
        if isinstance(sess, QuestSession):
            sess.bind(self.engine.block_keys(seq))
        for _ in self.engine.run(seq):
            pass
        wall = time.perf_counter() - t0
        return ArmRun(arm, sess, seq, wall, budget, self.engine.kv_dtype)


class PromptTooLong(ValueError):
    """The sample's prompt and response budget do not fit the model's positions."""

    def __init__(self, message: str, prompt_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens

    def hint(self, context_tokens: int, positions: int, max_tokens: int) -> str:
        """The message and the longest document that fits, the prompt's overhead
        (instruction, chunk headers) scaled to it: what ``--lengths`` can ask for."""
        fits = int((positions - max_tokens) * context_tokens / max(1, self.prompt_tokens))
        if fits < 256:
            return f"{self}; no document fits beside max_tokens {max_tokens}"
        size = f"{fits // 1024}K" if fits >= 1024 else str(fits)
        return f"{self}; at this prompt's overhead a document of {size} tokens fits"
