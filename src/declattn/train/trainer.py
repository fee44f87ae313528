"""Teacher-forced training of the engine's own decoder under DA masks.

The model is ``engine.models.decoder.Decoder``, the same module the engine serves, so
what is trained here loads and decodes unchanged. Training plugs a masked attention in
through the ``AttentionFn`` seam: the batch is padded to one length, each sequence gets
its ``transcript_mask``, and ``scaled_dot_product_attention`` applies it. Loss is
cross-entropy on output tokens only (the prompt is given, not learned).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.models.decoder import Decoder
from declattn.engine.models.token_context import TokenContext, token_context
from declattn.train.data import Example


class MaskedAttention:
    """An ``AttentionFn`` over a padded batch ``[B, L]`` with one ``[L, L]`` mask each."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask[:, None]  # [B, 1, L, L]
        self.batch, self.length = mask.shape[0], mask.shape[1]

    def __call__(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None
    ) -> Tensor:
        if window is not None:
            raise ValueError("training does not support sliding-window layers")
        b, n = self.batch, self.length

        def heads(x: Tensor) -> Tensor:
            return x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), attn_mask=self.mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # [B, L]
    labels: Tensor  # [B, L], -100 where no loss
    mask: Tensor  # [B, L, L]
    regions: list[list[int]]  # per sequence, per position (``Layout.regions``)

    def context(self, shift: int) -> TokenContext:
        """Token contexts of the flattened batch, built as the engine builds them."""
        b, n = self.input_ids.shape
        parts = [
            token_context(self.input_ids[i].tolist(), self.regions[i], range(n), shift)
            for i in range(b)
        ]
        return TokenContext.cat(parts)


PAD_REGION = -3
"""Padding is a region of its own, so no real token mixes a pad in, nor a pad a token."""


def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Right-pad to the longest; a pad row reads only itself and carries no loss."""
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(len(examples), 1, 1)
    regions = []
    for i, e in enumerate(examples):
        m = len(e.input_ids)
        ids[i, :m] = torch.tensor(e.input_ids)
        labels[i, :m] = torch.tensor(e.labels)
        mask[i, :m, :m] = e.mask
        regions.append([*e.regions, *[PAD_REGION] * (n - m)])
    return Batch(ids, labels, mask, regions)


def hidden_states(model: Decoder, batch: Batch) -> Tensor:
    """The decoder's final hidden states for the flattened batch: ``[B * L, hidden]``."""
    b, n = batch.input_ids.shape
    positions = torch.arange(n).repeat(b)
    config = model.config
    context = batch.context(config.token_shift) if config.needs_token_context else None
    return model(batch.input_ids.flatten(), positions, MaskedAttention(batch.mask), context)


def output_logits(model: Decoder, batch: Batch) -> tuple[Tensor, Tensor]:
    """Logits and targets of the batch's output tokens, in batch order."""
    hidden = hidden_states(model, batch)
    labels = batch.labels.flatten()
    rows = labels != -100
    return model.logits(hidden[rows]), labels[rows]


def loss_of(model: Decoder, batch: Batch) -> Tensor:
    """Mean cross-entropy over the batch's output tokens."""
    logits, targets = output_logits(model, batch)
    return F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class Schedule:
    """Warm-up, a long flat peak (the lookup forms late), then cosine to ``floor``."""

    peak: float
    steps: int
    warmup: int = 100
    flat_until: float = 0.6
    floor: float = 0.1

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        start = int(self.steps * self.flat_until)
        if step < start:
            return self.peak
        t = (step - start) / max(1, self.steps - start)
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass(frozen=True)
class Recipe:
    """The optimiser settings that made the lookup form (see the issue's feasibility run)."""

    steps: int
    lr: float = 2e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip: float = 1.0
    warmup: int = 100


def train(
    model: Decoder,
    batches: Callable[[int], Batch],
    recipe: Recipe,
    on_step: Callable[[int, float, float], None] | None = None,
) -> Iterator[float]:
    """Run ``recipe.steps`` optimiser steps on ``batches(step)``; yields each step's loss."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=recipe.lr, betas=recipe.betas,
    )
    schedule = Schedule(recipe.lr, recipe.steps, warmup=recipe.warmup)
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = schedule.lr(step)
        loss = loss_of(model, batches(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        value = float(loss.detach())
        if on_step is not None:
            on_step(step, value, schedule.lr(step))
        yield value
    model.eval()
