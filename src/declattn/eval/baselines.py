"""Sparse-attention baselines as engine controllers: StreamingLLM and Quest-style top-k.

Both run on the ordinary (vanilla) prompt and read a fixed number of KV blocks per
decode step on every global layer: the budget, which the harness takes from the DA
arm's measured mean blocks per step on the same sample, so the comparison is at equal
reads. Each keeps the attention sink's blocks and the block holding the newest token
(the step's own query sits there); they differ in how they spend the rest:

- StreamingLLM: the most recent blocks (a sliding window behind the sink).
- Quest: the blocks whose keys could score highest against the current query. Per
  block, the elementwise min and max of its keys bound ``q . k`` from above by
  ``sum_d max(q_d * max_d, q_d * min_d)``; a block's score is its highest bound over the
  query heads (a block is needed if any head needs it: the engine reads one set of
  blocks per layer for all heads). Selection runs per global layer with that layer's
  own query, through the engine's ``select_blocks`` hook, since the query of a decode
  step does not exist before the step runs.

Quest also reads its per-block bounds (two key-sized vectors per block and KV head)
every step; that is counted apart (``meta_bytes``), not in the block budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from declattn.api.session import Session
from declattn.da.scope import StepCount
from declattn.engine.kv import SequenceKeys


def sink_blocks(sink_tokens: int, block_size: int) -> int:
    """Blocks covering the first ``sink_tokens`` positions."""
    return -(-sink_tokens // block_size)


def streaming_view(n_blocks: int, budget: int, sink: int) -> list[int]:
    """StreamingLLM's blocks: the first ``sink`` blocks and the most recent ones, ``budget``
    in all (everything when the sequence is no longer than the budget)."""
    if budget < 1:
        raise ValueError("the budget must be at least one block")
    if budget >= n_blocks:
        return list(range(n_blocks))
    sink = min(sink, budget - 1)
    recent = budget - sink
    return [*range(sink), *range(n_blocks - recent, n_blocks)]


def quest_view(
    scores: Sequence[float] | Tensor, n_blocks: int, budget: int, sink: int
) -> list[int]:
    """Quest's blocks: sink and newest always, then the highest ``scores`` (ties to the
    lower block id) until ``budget`` blocks; ``scores[b]`` is block ``b``'s bound (only the
    blocks before the newest need one)."""
    if budget < 1:
        raise ValueError("the budget must be at least one block")
    if budget >= n_blocks:
        return list(range(n_blocks))
    newest = n_blocks - 1
    forced = set(range(min(sink, budget - 1))) | {newest}
    s = torch.as_tensor(scores, dtype=torch.float64)[:newest]
    free = budget - len(forced)
    if free > 0:
        mask = torch.zeros(newest, dtype=torch.bool)
        mask[sorted(b for b in forced if b < newest)] = True
        s = s.masked_fill(mask, float("-inf"))
        # A stable descending sort keeps the lower id first among equal scores.
        order = torch.sort(s, descending=True, stable=True).indices[:free]
        forced.update(int(b) for b in order)
    return sorted(forced)


def quest_scores(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Upper bound of ``q . k`` per block: ``q [H, D]``, ``kmin``/``kmax [Hkv, nb, D]`` ->
    ``[nb]``, the maximum over query heads."""
    n_kv, nb, dim = kmin.shape
    qg = q.float().reshape(n_kv, -1, dim)
    bound = qg.clamp(min=0) @ kmax.float().transpose(1, 2)
    bound += qg.clamp(max=0) @ kmin.float().transpose(1, 2)
    return bound.amax(dim=(0, 1)) if nb else bound.new_zeros(0)


class BlockBounds:
    """Per-layer elementwise min and max of each full block's keys, built as blocks fill.

    Blocks never change once full (nothing is evicted or renumbered), so each block's
    bounds are computed once, from the stored keys, the first time a step needs them.
    """

    def __init__(self, keys: SequenceKeys) -> None:
        self.keys = keys
        self._min: dict[int, Tensor] = {}
        self._max: dict[int, Tensor] = {}

    def get(self, layer: int, n_full: int) -> tuple[Tensor, Tensor]:
        lo_t = self._min.get(layer)
        have = 0 if lo_t is None else lo_t.shape[1]
        if n_full > have:
            keys = self.keys.blocks(layer, have, n_full)
            new_min, new_max = keys.amin(dim=2), keys.amax(dim=2)
            if lo_t is None:
                self._min[layer], self._max[layer] = new_min, new_max
            else:
                self._min[layer] = torch.cat([lo_t, new_min], dim=1)
                self._max[layer] = torch.cat([self._max[layer], new_max], dim=1)
        return self._min[layer][:, :n_full], self._max[layer][:, :n_full]


def budget_count(length: int, budget: int, block_size: int) -> StepCount:
    """What a step reads when it keeps ``budget`` blocks, the newest among them."""
    n_blocks = -(-length // block_size)
    kept = min(budget, n_blocks)
    newest_fill = length - (n_blocks - 1) * block_size
    return StepCount(
        logical=(kept - 1) * block_size + newest_fill,
        physical=kept * block_size,
        vanilla_logical=length,
        vanilla_physical=n_blocks * block_size,
    )


class BudgetSession(Session):
    """A vanilla request whose decode steps read ``budget`` blocks: the common part of
    the baselines (ordinary prompt, text, accounting); subclasses choose the blocks."""

    arm = "budget"

    def __init__(
        self, prompt_ids: Sequence[int], block_size: int, budget: int, sink_tokens: int = 16
    ) -> None:
        if budget < 1:
            raise ValueError("the budget must be at least one block")
        super().__init__(prompt_ids, block_size)
        self.budget = budget
        self.sink = sink_blocks(sink_tokens, block_size)
        self.expected_views: list[tuple[int, ...] | None] = []

    def _record(self, length: int) -> None:
        self.record(length, budget_count(length, self.budget, self.block_size))


class StreamingSession(BudgetSession):
    """StreamingLLM: attention sink plus the most recent blocks."""

    arm = "streaming"

    def view(self, length: int) -> list[int]:
        self._record(length)
        blocks = streaming_view(-(-length // self.block_size), self.budget, self.sink)
        self.expected_views.append(tuple(blocks))
        return blocks


class QuestSession(BudgetSession):
    """Quest-style query-aware selection, per global layer, from the current query.

    ``bind(keys)`` must be called once the engine has admitted the sequence
    (the bounds are read from its KV blocks).
    """

    arm = "quest"

    selects_blocks = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bounds: BlockBounds | None = None
        self.meta_bytes = 0
        self.selected: list[dict[int, tuple[int, ...]]] = []
        self._length = 0

    def bind(self, keys: SequenceKeys) -> None:
        """Give the session its sequence's stored keys (once the engine admitted it)."""
        self.bounds = BlockBounds(keys)

    def view(self, length: int) -> None:
        """All blocks as the fallback view; ``select_blocks`` decides per global layer."""
        self._record(length)
        self._length = length
        self.selected.append({})
        return None

    def select_blocks(self, layer: int, q: Tensor) -> list[int]:
        if self.bounds is None:
            raise RuntimeError("QuestSession.bind was not called")
        n_blocks = -(-self._length // self.block_size)
        if self.budget >= n_blocks:
            blocks = list(range(n_blocks))
        else:
            kmin, kmax = self.bounds.get(layer, n_blocks - 1)
            blocks = quest_view(quest_scores(q, kmin, kmax), n_blocks, self.budget, self.sink)
            self.meta_bytes += 2 * kmin.numel() * self.bounds.keys.element_size
        self.selected[-1][layer] = tuple(blocks)
        return blocks
