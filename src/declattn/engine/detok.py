"""Incremental detokenisation: one token in, the new text out.

Decoding the whole output each step keeps this exact for every tokenizer family
(byte-level BPE, SentencePiece spaces, multibyte characters split over tokens); text is
held back while it ends in an incomplete character.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REPLACEMENT = "\ufffd"


@dataclass
class Detokenizer:
    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith(_REPLACEMENT):
            return ""
        if not full.startswith(self.text):
            # A tokenizer that rewrites earlier text (rare): emit nothing new rather
            # than repeat; the final text stays the tokenizer's own decode.
            self.text = full
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta

    def flush(self) -> str:
        """At the end of a response, release whatever was held back."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
