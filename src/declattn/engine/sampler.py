"""Turning one row of logits into one token.

Each sequence carries its own parameters and its own seeded generator, so a request's
tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from declattn.engine.models.fused import layer_ops

GREEDY_BELOW = 1e-4
"""Temperatures below this sample greedily: dividing logits by them overflows to inf."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def generator(self) -> torch.Generator | None:
        """A private generator, so seeded requests are reproducible in any batch."""
        if self.temperature < GREEDY_BELOW:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from a ``[vocab]`` row of logits."""
    if params.temperature < GREEDY_BELOW:
        return greedy(logits)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


ARGMAX_DTYPES = (torch.bfloat16, torch.float32)
"""The dtypes the native argmax reads; others are converted to fp32 first."""


def greedy(logits: Tensor) -> int:
    """The index of the largest logit, the first where several tie (a NaN counts as the
    largest, as in ``torch.argmax``).

    On a CPU, the native ``argmax`` (``csrc/argmax.cpp``) reads the row in its own dtype
    where the library is had; else numpy's vectorised argmax over the row in fp32 (torch's
    CPU argmax is a scalar loop, slow over a vocabulary of ~150K). The three agree on ties,
    NaN and -inf (``tests/engine/test_sampler.py``)."""
    if logits.device.type != "cpu":
        return int(torch.argmax(logits))
    ops = layer_ops()  # None where DECLATTN_LAYER_KERNEL=torch or the library is not had
    if ops is None:
        return int(logits.detach().float().numpy().argmax())  # numpy has no bf16
    return int(ops.argmax(logits if logits.dtype in ARGMAX_DTYPES else logits.float()))


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of tokens whose mass reaches ``top_p`` (always at least one)."""
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop = before >= top_p
    drop[..., 0] = False  # the most likely token always stays, whatever top_p underflows to
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum()
