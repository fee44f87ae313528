"""Constrained decoding, torch side: a logits row restricted to the ids a DA constraint
allows (``declattn.da.constrain``). One function for our engine's sessions and the vLLM
plugin's trackers, so both mask the same way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from declattn.da.constrain import TokenConstraint


def mask_logits(logits: Tensor, allowed: Sequence[int] | np.ndarray) -> Tensor | None:
    """``logits`` with every id outside ``allowed`` at -inf; ``None`` where that would
    leave no finite logit (the sampler is never handed an all -inf row). Ids past the row
    (a vocabulary wider than the model's head) are ignored."""
    if isinstance(allowed, np.ndarray):
        idx = torch.from_numpy(allowed)
    else:
        idx = torch.as_tensor(allowed, dtype=torch.long)
    idx = idx.to(logits.device)
    if idx.numel() and int(idx.max()) >= logits.shape[-1]:
        idx = idx[idx < logits.shape[-1]]
    if not idx.numel():
        return None
    kept = logits[idx]
    if bool(torch.isneginf(kept).all()):
        return None
    out = torch.full_like(logits, float("-inf"))
    out[idx] = kept
    return out


def constrain(
    constraints: Sequence[TokenConstraint], logits: Tensor, pending: str, index: int
) -> Tensor:
    """The row to sample output token ``index`` from, given the tag reader's ``pending``
    text: each constraint in turn masks it where it applies, and records what it did."""
    for c in constraints:
        allowed = c.allowed_ids(pending)
        if allowed is None:
            continue
        out = mask_logits(logits, allowed)
        changed = out is not None and int(torch.argmax(out)) != int(torch.argmax(logits))
        c.stats.record(index, out is not None, changed)
        if out is not None:
            logits = out
    return logits
