"""Prefill a prompt once, then start every arm that shares it from a copy of its KV.

Three arms read the DA prompt (DA-nm, DA, DA constrained) and three the ordinary one
(vanilla, StreamingLLM, Quest). On a CPU a long prefill costs more than the whole
decode, so the harness prefills each prompt once, keeps the K/V of all its positions
but the last, and writes them into each arm's fresh sequence; the engine then prefills
the last prompt token for real, so the first output token still comes out of the model,
through the arm's own controller (its logits processor sees it).

Every arm starts this way, the first one too, so all arms of a prompt see identical
K/V and the same one-token final prefill: the comparison is exact, not approximate.
The copy is what ``PagedEngine.prefill_synthetic`` does with noise, with real values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from declattn.engine.engine import PagedEngine, Sequence_
from declattn.engine.sampler import SamplingParams

SNAPSHOT = "snapshot"


@dataclass
class PrefixKV:
    """K/V of a prompt's positions ``[0, n - 1)`` for every layer, on the cache's device."""

    prompt_ids: tuple[int, ...]
    k: list[Tensor]
    v: list[Tensor]
    seconds: float

    @property
    def n_positions(self) -> int:
        return len(self.prompt_ids) - 1


class _Snapshot:
    """Copies the sequence's K/V when its prefill ends (before the engine frees it)."""

    def __init__(self, engine: PagedEngine, n: int) -> None:
        self.engine, self.n = engine, n
        self.seq_id = -1
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def on_token(self, token_id: int, text: str) -> str:
        cache = self.engine.cache
        slots = cache.slots(self.seq_id, 0, self.n)
        self.k = [pool[:, slots].clone() for pool in cache.k]
        self.v = [pool[:, slots].clone() for pool in cache.v]
        return SNAPSHOT


def prefill_prefix(engine: PagedEngine, prompt_ids: list[int]) -> PrefixKV:
    """Prefill ``prompt_ids`` once and keep the K/V of all but its last position."""
    if len(prompt_ids) < 2:
        raise ValueError("a prompt of one token has no prefix to share")
    if engine.has_work:
        raise RuntimeError("prefill_prefix needs an idle engine")
    snap = _Snapshot(engine, len(prompt_ids) - 1)
    seq = engine.add(prompt_ids, SamplingParams(max_tokens=1), snap)
    snap.seq_id = seq.seq_id
    t0 = time.perf_counter()
    for _ in engine.run(seq):
        pass
    seconds = time.perf_counter() - t0
    if seq.finish_reason != SNAPSHOT or not snap.k:
        raise RuntimeError(f"prefill ended without a snapshot ({seq.finish_reason})")
    return PrefixKV(tuple(prompt_ids), snap.k, snap.v, seconds)


def start_from(
    engine: PagedEngine, prefix: PrefixKV, params: SamplingParams, controller: Any
) -> Sequence_:
    """Admit a sequence for ``prefix``'s prompt with its K/V already in place.

    The next ``engine.step()`` prefills only the last prompt token. The engine must be
    otherwise idle (the sequence is prefilled first among the waiting ones).
    """
    if engine.has_work:
        raise RuntimeError("start_from needs an idle engine")
    seq = engine.add(list(prefix.prompt_ids), params, controller)
    n = prefix.n_positions
    engine.cache.allocate(seq.seq_id, n)
    slots = engine.cache.slots(seq.seq_id, 0, n)
    with torch.inference_mode():
        for layer in range(len(engine.cache.k)):
            engine.cache.k[layer][:, slots] = prefix.k[layer]
            engine.cache.v[layer][:, slots] = prefix.v[layer]
    seq.prefilled = n
    return seq
