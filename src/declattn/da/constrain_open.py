"""The reply opens with a tag: its first token can only begin a declaration.

A zero-shot model asked for the economical reply sometimes answers in prose from the
first token, declares nothing, and so reads the whole context for every token of a reply
longer than the plain one, and is scored wrong for lacking ``<answer>`` (docs/eval.md,
"The per-answer study"). With this constraint (``DAOptions.open_tag``) the first token
must begin one of the tags the protocol opens a reply with: the focus head the
instruction teaches, ``<global>``, ``<local>`` or ``<answer>``. The model still chooses
which; the rest of the tag is the other constraints' and the fixed text's business.
``<answer>`` first is a plain answer inside tags, read in global.

Torch-free, like ``constrain.py``: it gives ids; ``declattn.api.constrained`` masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from declattn.da.constrain import ConstraintStats, token_texts

OPENINGS = ("<global>", "<local>", "<answer>")
"""The tags besides the focus heads a reply may open with."""


@dataclass(frozen=True)
class OpeningVocab:
    """The tokens whose text, written first, starts with ``<``: the only ones that can
    begin a tag (a few hundred of a vocabulary). Built once per tokenizer."""

    texts: Mapping[int, str]

    @classmethod
    def from_texts(cls, texts: Mapping[int, str]) -> OpeningVocab:
        """From each token's text as written at the start of a reply."""
        return cls({i: t for i, t in sorted(texts.items()) if t.startswith("<")})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> OpeningVocab:
        return cls.from_texts(token_texts(tokenizer, ""))

    def ids_for(self, heads: Sequence[str]) -> tuple[int, ...]:
        """Token ids whose text is the start of (or the whole of) an opening tag: one of
        ``OPENINGS`` or a focus head in ``heads``."""
        tags = (*heads, *OPENINGS)
        return tuple(i for i, t in self.texts.items() if any(tag.startswith(t) for tag in tags))


class OpeningConstraint:
    """Restricts the response's first token to ``ids``; off once a token is written."""

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("no token of this tokenizer can begin a tag")
        self.ids = np.asarray(ids, dtype=np.int64)
        self.stats = ConstraintStats()
        self.written = False

    def allowed_ids(self, pending: str) -> np.ndarray | None:
        """The opening ids before the first token; None after it."""
        return None if self.written else self.ids
