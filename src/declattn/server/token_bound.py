"""The fewest tokens a text can be, known before it is tokenised.

Tokenising a 5 MB context takes seconds; refusing it for being over the model's context
should not. No token stands for more input characters than its longest vocabulary entry,
so a text of ``n`` characters that the tokenizer all keeps is at least ``n / longest``
tokens: where even that is over the cap, the request is refused before tokenising it,
and the exact count decides for everything else.

The bound holds only for characters the tokenizer keeps, so only tokenizers whose
dropping is known get one: a BPE that writes every character as byte tokens (a
byte-level alphabet, or byte fallback). A byte-level vocabulary may still lack a byte's
symbol (SmolLM2's lacks six ASCII control characters, ``\\x16`` among them: BPE writes
no token for them), and those characters are not counted. A normalizer that composes
characters (NFC, NFKC: at most three code points into one, a Hangul syllable) widens the
bound threefold; a tokenizer that drops or merges input otherwise (whitespace collapsing
or stripping, a pre-tokenizer that discards spaces, an unknown token standing for a
whole word or a fused run) gets no bound at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import pre_tokenizers

COMPOSE_FACTOR = 3
"""Code points a Unicode normalizer may compose into one (Hangul L+V+T)."""
_PROBE = "a  b\t\t c\n\n\n d   e.  "
_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
"""The byte-level mapping (byte -> vocabulary symbol) that byte-level BPEs are built on."""


@dataclass(frozen=True)
class TokenBound:
    """How few tokens a text can be: each token stands for at most ``chars_per_token``
    characters, and the characters in ``dropped`` stand for none."""

    chars_per_token: int
    dropped: frozenset[str] = frozenset()

    def kept(self, text: str) -> int:
        """Characters of ``text`` that end in some token."""
        return len(text) - sum(text.count(c) for c in self.dropped)

    def fewest_tokens(self, text: str) -> int:
        """Tokens ``text`` is at least."""
        return -(-self.kept(text) // self.chars_per_token)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The bound for ``tokenizer``, or ``None`` where it may drop or merge input in ways
    not known here (or is not a Hugging Face fast tokenizer, whose parts are known)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _round_trips(tokenizer):
        return None
    parts = json.loads(backend.to_str())
    model = parts.get("model") or {}
    if model.get("type") != "BPE":
        return None
    vocab = tokenizer.get_vocab()
    if model.get("byte_fallback"):
        dropped: frozenset[str] | None = frozenset()
    elif _byte_level(parts.get("pre_tokenizer")):
        dropped = _dropped_bytes(vocab, model)
    else:
        dropped = None
    longest = max((len(t) for t in vocab), default=0)
    if dropped is None or longest < 1:
        return None
    return TokenBound(longest * (1 if backend.normalizer is None else COMPOSE_FACTOR), dropped)


def _round_trips(tokenizer: Any) -> bool:
    """Whether runs of whitespace come back as they went in."""
    try:
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        kept = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except Exception:  # an exotic tokenizer: no bound rather than a wrong one
        return False
    return kept == _PROBE


def _byte_level(pre: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer (as serialised) maps the text to byte-level symbols."""
    if not pre:
        return False
    return pre.get("type") == "ByteLevel" or any(
        _byte_level(p) for p in pre.get("pretokenizers") or ())


def _dropped_bytes(vocab: dict[str, int], model: dict[str, Any]) -> frozenset[str] | None:
    """ASCII characters whose byte a byte-level vocabulary lacks (BPE writes nothing for
    them), or ``None`` where more may go: longer characters whose every byte could be
    missing, or an unknown token that could stand for a run of characters."""
    missing = [chr(b) for b in range(128) if _symbols(chr(b))[0] not in vocab]
    leads = (_symbols(c)[0] for c in _LEAD_EXAMPLES)
    follows = (_symbols(chr(0x80 + i))[1] for i in range(64))  # C2 80 .. C2 BF
    if not all(s in vocab for s in leads) and not all(s in vocab for s in follows):
        return None
    if model.get("unk_token") is not None:
        return None if missing and model.get("fuse_unk") else frozenset()
    return frozenset(missing)


def _symbols(text: str) -> str:
    return "".join(piece for piece, _ in _BYTES.pre_tokenize_str(text))


_LEAD_EXAMPLES = (
    [chr((b & 0x1F) << 6) for b in range(0xC2, 0xE0)]
    + [chr(0x800)] + [chr((b & 0x0F) << 12) for b in range(0xE1, 0xF0)]
    + [chr(0x10000)] + [chr((b & 0x07) << 18) for b in range(0xF1, 0xF5)]
)
"""A character for each lead byte of a longer UTF-8 sequence (0xC2-0xF4). While every lead
byte, or every continuation byte (0x80-0xBF), has its symbol, every character of two or
more bytes ends in some token (SmolLM2 lacks the leads 0xF1 and 0xF2, of unassigned
planes 4-11, but has every continuation byte)."""
