"""The arms of an evaluation, all run by the same engine on the same sample.

- ``vanilla``: the ordinary prompt (context and question in one user turn), full reads;
- ``da-nm``: the DA prompt, tags read but nothing masked (what the prompt alone does);
- ``da``: DA with masking, no decoding constraint;
- ``da-constrained``: DA with masking and the focus-declaration constraint;
- ``streaming``: StreamingLLM on the ordinary prompt, at DA's mean blocks per step;
- ``quest``: Quest-style top-k blocks on the ordinary prompt, at the same budget.

The sparse arms take their budget from the ``da`` arm of the same sample, so ``da``
runs first. ``ORDER`` also groups the arms by prompt, so one prompt's shared prefill is
alive at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from declattn.engine.engine import Sequence_
from declattn.engine.sampler import SamplingParams
from declattn.eval.baselines import QuestSession, StreamingSession, sink_blocks
from declattn.eval.prefix import PrefixKV, prefill_prefix, start_from
from declattn.session import DAOptions

ARMS = ("vanilla", "da-nm", "da", "da-constrained", "streaming", "quest")
ORDER = ("da", "da-nm", "da-constrained", "vanilla", "streaming", "quest")
DA_ARMS = ("da-nm", "da", "da-constrained")
SPARSE_ARMS = ("streaming", "quest")


def parse_arms(spec: str) -> list[str]:
    """Arm names from a comma list (or ``all``), in run order; sparse arms need ``da``."""
    names = list(ARMS) if spec.strip() == "all" else [a.strip() for a in spec.split(",") if a]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}, all")
    if not names:
        raise ValueError("no arm given")
    if any(a in SPARSE_ARMS for a in names) and "da" not in names:
        raise ValueError("the streaming and quest arms take their budget from the da arm: add da")
    return [a for a in ORDER if a in names]


@dataclass(frozen=True)
class ArmSettings:
    """What every arm of a run shares."""

    max_tokens: int = 192
    chunk_target: int = 2048
    chunk_cap: int = 2560
    sink: int = 16

    def da_options(self, arm: str) -> DAOptions:
        return DAOptions(
            target=self.chunk_target,
            cap=self.chunk_cap,
            sink=self.sink,
            masking=arm != "da-nm",
            constrain=arm == "da-constrained",
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
    session: Any
    seq: Sequence_
    wall_seconds: float
    prefill_seconds: float
    budget: int | None = None
    kv_dtype: str | None = None


class ArmRunner:
    """Runs arms on one engine, sharing each prompt's prefill between the arms that read it."""

    def __init__(self, engine: Any, settings: ArmSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._prefix: PrefixKV | None = None

    def session(self, arm: str, context: str, question: str, budget: int | None) -> Any:
        e, s = self.engine, self.settings
        if arm in DA_ARMS:
            return e.session(
                context, question, da=True, options=s.da_options(arm), max_tokens=s.max_tokens
            )
        if arm == "vanilla":
            return e.session(context, question, da=False)
        if budget is None:
            raise ValueError(f"the {arm} arm needs a budget (from the da arm)")
        cls = StreamingSession if arm == "streaming" else QuestSession
        return cls(e.tokenizer, context, question, e.block_size, budget, s.sink)

    def prompt_fits(self, n_prompt: int) -> bool:
        limit = self.engine.loaded.config.max_position_embeddings
        return n_prompt + self.settings.max_tokens <= limit

    def run(self, arm: str, context: str, question: str, budget: int | None = None) -> ArmRun:
        sess = self.session(arm, context, question, budget)
        if not self.prompt_fits(len(sess.prompt_ids)):
            limit = self.engine.loaded.config.max_position_embeddings
            raise PromptTooLong(
                f"prompt of {len(sess.prompt_ids)} tokens + max_tokens "
                f"{self.settings.max_tokens} exceeds the model's {limit} positions"
            )
        prefix = self._prefix_for(sess.prompt_ids)
        core = self.engine.core
        params = SamplingParams(max_tokens=self.settings.max_tokens)
        t0 = time.perf_counter()
        seq = start_from(core, prefix, params, sess)
        if isinstance(sess, QuestSession):
            sess.bind(core.cache, seq.seq_id)
        for _ in core.run(seq):
            pass
        wall = time.perf_counter() - t0
        kv_dtype = str(core.cache.config.dtype).removeprefix("torch.")
        return ArmRun(arm, sess, seq, wall, prefix.seconds, budget, kv_dtype)

    def _prefix_for(self, prompt_ids: list[int]) -> PrefixKV:
        if self._prefix is None or self._prefix.prompt_ids != tuple(prompt_ids):
            self._prefix = None  # free the previous prompt's K/V before the next prefill
            self._prefix = prefill_prefix(self.engine.core, prompt_ids)
        return self._prefix

    def forget(self) -> None:
        """Drop the shared prefill (between samples)."""
        self._prefix = None


class PromptTooLong(ValueError):
    """The sample's prompt and response budget do not fit the model's positions."""
