"""Dense reference attention for one sequence: the yardstick for the paged attention.

It keeps every key and value of every layer in plain growing tensors and attends with an
explicit fp32 softmax over an explicit mask, so that its correctness can be checked by
reading it. Speed is not a goal.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DenseAttention:
    """An ``AttentionFn`` for a single sequence, without paging.

    Each call appends the step's keys and values of ``layer`` and lets the step's queries
    attend causally over everything stored for that layer. The new tokens are taken to sit
    at the end of the sequence (positions ``length - T .. length - 1``), so a prefill
    followed by one-token calls reproduces a full forward pass.
    """

    def __init__(self) -> None:
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}

    def length(self, layer: int = 0) -> int:
        """Tokens stored for ``layer``."""
        keys = self._keys.get(layer)
        return 0 if keys is None else keys.shape[0]

    def reset(self) -> None:
        self._keys.clear()
        self._values.clear()

    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> Tensor:
        if layer in self._keys:
            k = torch.cat((self._keys[layer], k))
            v = torch.cat((self._values[layer], v))
        self._keys[layer], self._values[layer] = k, v
        return dense_attention(q, k, v, scale=scale, window=window)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None) -> Tensor:
    """Causal (optionally sliding-window) GQA attention of the last ``T`` positions.

    ``q``: ``[T, Hq, D]`` for the last T of the S stored positions; ``k``, ``v``:
    ``[S, Hkv, D]``. A query at position p sees key j when ``j <= p`` and, with a window W,
    ``p - j < W`` (W positions, itself included). Returns ``[T, Hq, D]`` in ``q``'s dtype.
    """
    t, num_heads, _ = q.shape
    s, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    q_pos = torch.arange(s - t, s, device=q.device)[:, None]
    k_pos = torch.arange(s, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (q_pos - k_pos < window)
    keys = k.float().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", probs, values)
    return out.to(q.dtype)
