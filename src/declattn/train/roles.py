"""What each reply token asks of the model, and how well a model does each, teacher forced.

A declaring reply mixes easy tokens with the two that need a lookup::

    <global> e17</global><focus magic_chunks="5"> e17 e201</focus><answer> e201</answer>
    format   key copy    format              chunk key copy value lookup   answer copy

The tags are fixed format; a key copy repeats the question's (or the previous hop's)
entity, and the answer copies the focus block. Only the chunk id (which paragraph holds
the key) and the value lookup (the entity after the key in that paragraph) need the
model to find something in the document. A loss curve cannot tell these apart: a model
that learned every copy sits at a low loss while both lookups stay at chance, which is
how the first da-tiny runs failed. ``role_report`` scores each role separately.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ROLES = ("format", "key copy", "chunk id", "value lookup", "answer copy")
_FOCUS_OPEN = '<focus magic_chunks="'


def reply_roles(texts: Sequence[str]) -> list[str]:
    """The role of each reply token, from the token texts alone (any number of hops)."""
    roles, block, entities, after_open = [], "", 0, False
    for t in texts:
        word = t.strip()
        role = "format"
        if after_open:
            role, after_open = "chunk id", False
        elif word in _OPENERS:
            block, entities, after_open = _OPENERS[word], 0, word == _FOCUS_OPEN
        elif _is_entity(word):
            entities += 1
            role = "answer copy" if block == "answer" else "key copy"
            if block == "focus" and entities == 2:
                role = "value lookup"
        roles.append(role)
    return roles


_OPENERS = {"<global>": "global", _FOCUS_OPEN: "focus", "<answer>": "answer"}


def _is_entity(word: str) -> bool:
    return word.startswith("e") and word[1:].isdigit()


@dataclass(frozen=True)
class RoleScore:
    role: str
    tokens: int
    accuracy: float  # greedy argmax equals the target
    loss: float  # mean cross-entropy (nats)


def role_report(
    model: Any, tokenizer: Any, n_chunks: int, samples: int = 64, seed: int = 0,
    two_hop: bool = False,
) -> list[RoleScore]:
    """Teacher-forced accuracy and loss per role on fresh documents, under DA masks."""
    from declattn.train.data import da_tiny_options, encode
    from declattn.train.evaluate import EVAL_SEED_BASE
    from declattn.train.tasks import make_episode

    rng = random.Random(EVAL_SEED_BASE + 17 * seed + n_chunks)
    examples = [
        encode(tokenizer, make_episode(rng, n_chunks, two_hop), da_tiny_options())
        for _ in range(samples)
    ]
    return score_roles(model, examples, tokenizer.pad_token_id)


def score_roles(model: Any, examples: Sequence[Any], pad_id: int) -> list[RoleScore]:
    """Accuracy and loss per role over ``examples`` (``train.data.Example``), one batch."""
    from declattn.train.trainer import collate, output_logits

    with torch.no_grad():
        logits, targets = output_logits(model, collate(examples, pad_id))
        loss = F.cross_entropy(logits, targets, reduction="none")
        right = logits.argmax(-1) == targets
    roles = [r for e in examples for r in reply_roles(e.output_texts)]
    out = []
    for role in ROLES:
        idx = torch.tensor([i for i, r in enumerate(roles) if r == role], dtype=torch.long)
        if len(idx):
            out.append(RoleScore(role, len(idx), float(right[idx].float().mean()),
                                 float(loss[idx].mean())))
    return out
