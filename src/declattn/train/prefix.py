"""Teacher forcing in two passes: the chunks without gradient, the rest with it.

A training sequence of a real model is a few thousand prompt tokens (the chunks) and a
few hundred that matter for the loss (the question window, the replies, the turns
between them). The first pass runs the decoder over the chunks under ``no_grad`` and
keeps every layer's keys and values; the second runs the rest with gradients, its
attention reading those keys and values (constants) and its own, under the rows of the
sequence's DA mask. Every row sees exactly what the one-pass forward would show it, so
the loss is the same; only the gradient that would flow back into how the chunks are
encoded is dropped, which makes a step about half the cost of a full backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.models.decoder import Decoder


def _heads(x: Tensor) -> Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


class PrefixPass:
    """The first pass's ``AttentionFn``: causal attention, each layer's K/V kept."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None
    ) -> Tensor:
        if window is not None:
            raise ValueError("training does not support sliding-window layers")
        self.kv[layer] = (k, v)
        out = F.scaled_dot_product_attention(
            _heads(q), _heads(k), _heads(v), is_causal=True, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)


class RestPass:
    """The second pass's ``AttentionFn``: rows ``[start, L)`` of the mask over the kept
    K/V of ``[0, start)`` and the pass's own."""

    def __init__(self, prefix: PrefixPass, mask_rows: Tensor) -> None:
        self.prefix = prefix
        self.mask = mask_rows[None, None]  # [1, 1, rows, L]

    def __call__(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None
    ) -> Tensor:
        if window is not None:
            raise ValueError("training does not support sliding-window layers")
        pk, pv = self.prefix.kv[layer]
        keys, values = torch.cat((pk, k)), torch.cat((pv, v))
        out = F.scaled_dot_product_attention(
            _heads(q), _heads(keys), _heads(values), attn_mask=self.mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)


def two_pass_logits(
    model: Decoder, input_ids: Tensor, labels: Tensor, mask: Tensor, frozen: int
) -> tuple[Tensor, Tensor]:
    """Logits and targets of the rows with a label. ``frozen``: positions ``[0, frozen)``
    go through the first pass (none of them may carry a label)."""
    if bool((labels[:frozen] != -100).any()):
        raise ValueError("a labelled row lies in the frozen prefix")
    n = input_ids.shape[0]
    positions = torch.arange(n)
    prefix = PrefixPass()
    with torch.no_grad():
        model(input_ids[:frozen], positions[:frozen], prefix)
    prefix.kv = {i: (k.detach(), v.detach()) for i, (k, v) in prefix.kv.items()}
    hidden = model(input_ids[frozen:], positions[frozen:], RestPass(prefix, mask[frozen:]))
    rest = labels[frozen:]
    rows = rest != -100
    return model.logits(hidden[rows]), rest[rows]


def two_pass_loss(
    model: Decoder, input_ids: Tensor, labels: Tensor, mask: Tensor, frozen: int
) -> tuple[Tensor, int]:
    """Summed cross-entropy over the labelled rows, and their count."""
    logits, targets = two_pass_logits(model, input_ids, labels, mask, frozen)
    return F.cross_entropy(logits, targets, reduction="sum"), int(targets.numel())
