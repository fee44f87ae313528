"""Incremental detokenisation: one token in, the new text out.

The text of a response is the tokenizer's decode of its ids (byte-level BPE,
SentencePiece spaces, multibyte characters split over tokens); text is held back while
it ends in an incomplete character.

Where the tokenizer is a Hugging Face one backed by the ``tokenizers`` library (every
shipped model's), ``tokenizers.decoders.DecodeStream`` gives each token's text from a
window of the last few ids, so a step costs the same at token 10 and token 10,000.
Decoding the whole output every step, as the general path below does, made the
engine's detokenising grow with the response (49 us at 200 tokens, 130 us at 600 on
the Xeon guest, qwen2.5's tokenizer, 2026-12-04: a quadratic response). A tokenizer
that cleans up spaces after decoding (``clean_up_tokenization_spaces``), which a
stream cannot see, takes the general path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


def _backend(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` whose decode is ``tokenizer.decode``'s, or ``None``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    return backend if isinstance(backend, Tokenizer) and not cleans_up else None


@dataclass
class Detokenizer:
    """The text of a response so far (``text``) and of each new token (``add``)."""

    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""
    _backend: Tokenizer | None = field(init=False, repr=False, default=None)
    _stream: DecodeStream | None = field(init=False, repr=False, default=None)
    _last: str = field(init=False, repr=False, default="")
    _owed: str = field(init=False, repr=False, default="")

    def __post_init__(self) -> None:
        self._backend = _backend(self.tokenizer)
        if self._backend is not None and not self.ids:
            self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty). After
        ``take_back``, text the taken-back token had given is not given again."""
        self._last = delta = self._add(token_id)
        if not self._owed:
            return delta
        owed, self._owed = self._owed, ""
        if delta.startswith(owed):
            return delta[len(owed) :]
        if owed.startswith(delta):
            self._owed = owed[len(delta) :]
            return ""
        raise ValueError(f"token healing: the new text {delta!r} does not start with the "
                         f"taken-back text {owed!r}")

    def take_back(self) -> None:
        """Forget the newest token (token healing). Its text was given and stays given:
        the text of the tokens added next must start with it, and only what follows it
        is returned."""
        if self._owed:
            raise ValueError("token healing: a token is already taken back")
        self.ids.pop()
        self.text = self.text[: len(self.text) - len(self._last)]
        self._owed, self._last = self._last, ""
        if self._stream is not None:  # a stream cannot step back: replay the rest once
            self._stream = DecodeStream(skip_special_tokens=True)
            for token_id in self.ids:
                self._stream.step(self._backend, token_id)

    def _add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, token_id) or ""
            except Exception:  # the stream refuses text that rewrites itself: decode all
                self._stream = None
            else:
                self.text += delta
                return delta
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
