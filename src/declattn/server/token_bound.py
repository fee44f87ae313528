"""The fewest tokens a text can be, known before it is tokenised.

Tokenising a 5 MB context takes seconds; refusing it for being over the model's context
should not. No token of a lossless tokenizer stands for more input characters than its
longest vocabulary entry, so a text of ``n`` characters is at least ``n / longest``
tokens: where even that is over the cap, the request is refused before tokenising it,
and the exact count decides for everything else.

The bound holds only where every input character is kept. A normalizer that composes
characters (NFC, NFKC: at most three code points into one, a Hangul syllable) widens it
threefold; a tokenizer that drops or merges input (whitespace collapsing or stripping,
a pre-tokenizer that splits on spaces and discards them) gets no bound at all, which a
round trip of a probe text with runs of whitespace finds out.
"""

from __future__ import annotations

from typing import Any

COMPOSE_FACTOR = 3
"""Code points a Unicode normalizer may compose into one (Hangul L+V+T)."""
_PROBE = "a  b\t\t c\n\n\n d   e.  "


def max_chars_per_token(tokenizer: Any) -> int | None:
    """Input characters one token can stand for at most, or ``None`` where the tokenizer
    may drop input (or is not a Hugging Face fast tokenizer, whose parts are known)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        kept = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except Exception:  # an exotic tokenizer: no bound rather than a wrong one
        return None
    if kept != _PROBE:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    if longest < 1:
        return None
    return longest * (1 if backend.normalizer is None else COMPOSE_FACTOR)


def fewest_tokens(chars: int, chars_per_token: int | None) -> int:
    """Tokens a text of ``chars`` characters is at least (0 without a bound)."""
    return -(-chars // chars_per_token) if chars_per_token else 0
