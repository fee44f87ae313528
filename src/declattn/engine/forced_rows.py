"""Several decode rows of one sequence in one forward: its newest token and the forced
tokens after it (``Controller.forced``), each row reading its own view.

A decode row alone goes to the fused kernel, which walks its kept rows once per KV head.
That kernel has no causal limit inside a row's runs and returns no log-sum-exp to merge
two calls, so rows of one sequence at consecutive positions cannot share one walk there.
Here they share one gather instead: the union of the rows' kept blocks is read from the
pool once, and each row attends to its own part of it (its view, up to its own position)
through one masked attention call. A row that reads everything and a sliding-window layer
need no gather: they are a causal prefill over the positions concerned, read once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.runs import checked_view


@dataclass(frozen=True, eq=False)
class RowsPlan:
    """What the decode rows of one sequence read on global layers.

    ``blocks[i]``: the logical blocks row ``i`` (position ``start + i``) reads. ``full``:
    every row reads every block up to its own (no gather: a causal prefill read).
    Otherwise ``index`` holds the pool rows of every position some row reads, in
    logical order, and ``mask[i, j]`` whether row ``i`` reads the ``j``-th of them."""

    start: int
    blocks: tuple[tuple[int, ...], ...]
    full: bool
    index: Tensor | None
    mask: Tensor | None

    @property
    def n_keys(self) -> int:
        """Positions gathered for the rows' global layers (all of them when ``full``)."""
        if self.index is None:
            return self.start + len(self.blocks)
        return int(self.index.numel())


def plan_rows(
    seq_id: int,
    table: np.ndarray,
    start: int,
    views: Sequence[Sequence[int] | None],
    block_size: int,
    device: str,
) -> RowsPlan:
    """The global-layer reads of rows at positions ``start .. start + len(views) - 1``
    of a sequence whose logical block ``b`` sits in pool block ``table[b]``; ``views[i]``
    is row ``i``'s view (``None``: everything), checked as a decode row's is."""
    bs = block_size
    blocks: list[tuple[int, ...]] = []
    full = True
    for i, view in enumerate(views):
        n_blocks = -(-(start + i + 1) // bs)
        kept = range(n_blocks) if view is None else checked_view(seq_id, view, n_blocks)
        blocks.append(tuple(int(b) for b in kept))
        full = full and len(kept) == n_blocks  # checked: unique, in range
    if full:
        return RowsPlan(start, tuple(blocks), True, None, None)
    length = start + len(views)
    union = np.unique(np.concatenate([np.asarray(b, dtype=np.int64) for b in blocks]))
    positions = (union[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
    positions = positions[positions < length]
    rows = table[positions // bs] * bs + positions % bs
    mask = np.zeros((len(views), positions.size), dtype=bool)
    for i, kept in enumerate(blocks):
        mask[i] = np.isin(positions // bs, kept) & (positions <= start + i)
    return RowsPlan(
        start,
        tuple(blocks),
        False,
        torch.from_numpy(rows).to(device),
        torch.from_numpy(mask).to(device),
    )


def rows_attention(plan: RowsPlan, q: Tensor, kp: Tensor, vp: Tensor, scale: float) -> Tensor:
    """Attention of the rows ``q [n, H, D]`` over the positions ``plan`` gathers from the
    pools ``kp, vp [Hkv, rows, D]``, each row masked to its own view (not ``full``
    plans: those are a causal prefill). Returns ``[n, H, D]`` in ``q``'s dtype."""
    assert plan.index is not None and plan.mask is not None
    k = kp.index_select(1, plan.index)
    v = vp.index_select(1, plan.index)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.permute(1, 0, 2).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=plan.mask[None, None], scale=scale, enable_gqa=True,
    )
    return out[0].permute(1, 0, 2)


def window_blocks(start: int, n: int, window: int, block_size: int) -> list[tuple[int, ...]]:
    """The blocks each of ``n`` rows from ``start`` reads on a sliding-window layer."""
    out = []
    for i in range(n):
        p = start + i
        out.append(tuple(range(max(0, p - window + 1) // block_size, p // block_size + 1)))
    return out


def window_keys(start: int, n: int, window: int) -> int:
    """Positions the rows read together on a sliding-window layer (one read)."""
    return start + n - max(0, start - window + 1)


__all__ = ["RowsPlan", "plan_rows", "rows_attention", "window_blocks", "window_keys"]
