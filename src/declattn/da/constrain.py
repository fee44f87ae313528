"""Constrained focus declarations: once a model starts naming chunks, it names valid ones.

Two constraints share the interface ``allowed_ids(pending)`` (``TokenConstraint``)
and the ``ConstraintStats``: ``FocusConstraint`` for ``<focus magic_chunks="K">`` (here) and
``FindConstraint`` for ``<focus find="WORDS">`` (``constrain_find.py``). Each leaves the
logits alone outside its own declaration, so a session may apply either or both.

The focus-id constraint

A small model that opens ``<focus magic_chunks="`` often finishes it badly: an id past
the last chunk, a stray letter, a missing quote. The reader then declines, which is safe
but wastes the model's intent. While the tag is being written, this module masks the
logits so that only tokens keeping the tag on a path to a valid declaration survive. The
model still picks *which* chunks; it can no longer pick a malformed or unknown one.

The constrained region starts once the attribute name is written (``<focus magic_chunks``,
so a single token like ``=""`` cannot slip through) and ends at the ``>``. Within it a
token is allowed when the tag part of its text (everything up to and including its first
``>``; what follows the ``>`` is ordinary output) keeps the tag a prefix of a valid focus
declaration that still fits in ``MAX_TAG_LEN``, or completes one.

Tokens with no text (end of sequence, other special tokens) are masked there too: a
response cannot stop half-way through a tag.

Valid here is slightly stricter than what the reader accepts, so that anything allowed is
accepted: ids are 1..n_chunks with no leading zero, at most ``MAX_FOCUS_IDS`` written, the
closing quote matches the opening one (or there is none), spaces and tabs where the reader
tolerates them.

This is torch-free: it turns the tag reader's pending text into the ids that may come
next; ``declattn.api.constrained`` masks a logits row with them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from declattn.protocol.grammar import MAX_FOCUS_IDS, MAX_TAG_LEN

TAG_CHARS = frozenset("0123456789,\"' \t=>")
"""Characters a constrained token's tag part may contain."""

_HEAD_RE = re.compile(r"<focus[ \t]+magic_chunks")
_SPACE = " \t"
_QUOTES = "\"'"
_REFERENCE = "<focus magic_chunks="
"""Decoded before each token, so a token's text is what it adds at the place it matters
(SentencePiece tokens lose their leading space when decoded alone)."""


class _Phase(Enum):
    NAME = 0  # after "magic_chunks": spaces, then "="
    EQ = 1  # after "=": spaces, then a quote or a first digit (bare list)
    LIST = 2  # after the opening quote: spaces, then a digit
    NUM = 3  # inside an id
    AFTER_NUM = 4  # spaces after an id: a comma, the closing quote, or ">" when bare
    COMMA = 5  # after a comma: spaces, then a digit
    CLOSED = 6  # after the closing quote: spaces, then ">"
    DONE = 7  # the ">" is written
    DEAD = 8  # no valid declaration starts this way


@dataclass(frozen=True)
class _State:
    phase: _Phase
    quote: str = ""  # "" while unknown or for a bare list
    digits: str = ""
    n_ids: int = 0


_DEAD = _State(_Phase.DEAD)
_SPACED = frozenset(
    {_Phase.NAME, _Phase.EQ, _Phase.LIST, _Phase.AFTER_NUM, _Phase.COMMA, _Phase.CLOSED}
)  # phases where spaces and tabs may repeat


def _start_id(s: _State, ch: str, n_chunks: int) -> _State:
    if ch == "0" or int(ch) > n_chunks or s.n_ids >= MAX_FOCUS_IDS:
        return _DEAD
    return _State(_Phase.NUM, s.quote, ch, s.n_ids + 1)


def _after_id(s: _State, ch: str) -> _State:
    """A comma, closing quote or ``>`` right after an id (or the spaces after it)."""
    if ch == ",":
        return _State(_Phase.COMMA, s.quote, "", s.n_ids) if s.n_ids < MAX_FOCUS_IDS else _DEAD
    if s.quote and ch == s.quote:
        return _State(_Phase.CLOSED, s.quote, "", s.n_ids)
    if not s.quote and ch == ">":
        return _State(_Phase.DONE, s.quote, "", s.n_ids)
    return _DEAD


def _step(s: _State, ch: str, n_chunks: int) -> _State:
    p = s.phase
    if ch in _SPACE:
        if p is _Phase.NUM:
            return _State(_Phase.AFTER_NUM, s.quote, "", s.n_ids)
        return s if p in _SPACED else _DEAD
    if p is _Phase.NAME:
        return _State(_Phase.EQ) if ch == "=" else _DEAD
    if p is _Phase.EQ:
        if ch in _QUOTES:
            return _State(_Phase.LIST, ch)
        return _start_id(s, ch, n_chunks) if ch.isdigit() and ch.isascii() else _DEAD
    if p in (_Phase.LIST, _Phase.COMMA):
        return _start_id(s, ch, n_chunks) if ch.isdigit() and ch.isascii() else _DEAD
    if p is _Phase.NUM:
        if ch.isdigit() and ch.isascii():
            digits = s.digits + ch
            return (
                _State(_Phase.NUM, s.quote, digits, s.n_ids) if int(digits) <= n_chunks else _DEAD
            )
        return _after_id(s, ch)
    if p is _Phase.AFTER_NUM:
        return _after_id(s, ch)
    if p is _Phase.CLOSED:
        return _State(_Phase.DONE, s.quote, "", s.n_ids) if ch == ">" else _DEAD
    return _DEAD  # nothing may follow DONE within a tag part


def _advance(s: _State, text: str, n_chunks: int) -> _State:
    for ch in text:
        s = _step(s, ch, n_chunks)
        if s.phase is _Phase.DEAD:
            break
    return s


def _to_finish(s: _State) -> int:
    """The fewest characters that turn ``s`` into a complete declaration."""
    closing = 2 if s.quote else 1  # quote + ">" or just ">"
    return {
        _Phase.NAME: 3,  # =1>
        _Phase.EQ: 2,  # 1>
        _Phase.LIST: 1 + closing,
        _Phase.NUM: closing,
        _Phase.AFTER_NUM: closing,
        _Phase.COMMA: 1 + closing,
        _Phase.CLOSED: 1,
        _Phase.DONE: 0,
    }.get(s.phase, MAX_TAG_LEN + 1)


def _pending_state(pending: str, n_chunks: int) -> _State | None:
    m = _HEAD_RE.match(pending)
    if m is None:
        return None
    if n_chunks < 1:
        return _DEAD  # no id can be valid
    return _advance(_State(_Phase.NAME), pending[m.end() :], n_chunks)


def in_declaration(pending: str) -> bool:
    """Whether the reader's pending text is a focus tag past its attribute name.

    A superset of ``TagReader.inside_chunk_ids``: it also covers the ``=`` still to come
    and the ``>`` after the closing quote, the two places a one-token slip would
    otherwise break the tag.
    """
    return _HEAD_RE.match(pending) is not None


def continues(pending: str, piece: str, n_chunks: int) -> bool:
    """Whether writing ``piece`` after ``pending`` keeps the focus tag valid or completes it.

    Only ``piece``'s tag part counts; text after its first ``>`` is ordinary output.
    """
    state = _pending_state(pending, n_chunks)
    return state is not None and _fits(state, len(pending), tag_part(piece), n_chunks)


def _fits(state: _State, used: int, part: str, n_chunks: int) -> bool:
    if state.phase is _Phase.DEAD or not part:
        return False
    after = _advance(state, part, n_chunks)
    if part.endswith(">"):
        return after.phase is _Phase.DONE and used + len(part) <= MAX_TAG_LEN
    return after.phase is not _Phase.DEAD and used + len(part) + _to_finish(after) <= MAX_TAG_LEN


def tag_part(text: str) -> str:
    """``text`` up to and including its first ``>``; all of it if it has none."""
    gt = text.find(">")
    return text if gt < 0 else text[: gt + 1]


@dataclass(frozen=True)
class FocusVocab:
    """The tokens that can ever be written inside a focus declaration, with their tag parts.

    Built once per tokenizer: a few hundred out of tens of thousands, so each constrained
    step checks only these.
    """

    ids: tuple[int, ...]
    parts: tuple[str, ...]

    @classmethod
    def from_texts(cls, texts: Mapping[int, str]) -> FocusVocab:
        """From each token's text as written mid-output (what the detokenizer emits)."""
        ids, parts = [], []
        for token_id, text in sorted(texts.items()):
            part = tag_part(text)
            if part and set(part) <= TAG_CHARS:
                ids.append(token_id)
                parts.append(part)
        return cls(tuple(ids), tuple(parts))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> FocusVocab:
        """Decode each token after the start of a focus tag and keep the ones that fit."""
        return cls.from_texts(token_texts(tokenizer, _REFERENCE))

    def allowed(self, pending: str, n_chunks: int) -> list[int] | None:
        """Token ids that may come next; None when ``pending`` is not in a declaration."""
        state = _pending_state(pending, n_chunks)
        if state is None:
            return None
        used = len(pending)
        return [
            i
            for i, part in zip(self.ids, self.parts, strict=True)
            if _fits(state, used, part, n_chunks)
        ]


def token_texts(tokenizer: Any, reference: str) -> dict[int, str]:
    """Each token's text as written right after ``reference`` (what the detokenizer
    emits mid-output; SentencePiece tokens lose their leading space decoded alone)."""
    prefix = list(tokenizer.encode(reference, add_special_tokens=False))
    base = tokenizer.decode(prefix, skip_special_tokens=True)
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    texts: dict[int, str] = {}
    for token_id in range(size):
        full = tokenizer.decode(prefix + [token_id], skip_special_tokens=True)
        if full.startswith(base) and len(full) > len(base):
            texts[token_id] = full[len(base) :]
    return texts


class VocabCache:
    """One vocabulary table per tokenizer, built on first use (a fraction of a second to
    a few seconds, depending on the vocabulary size): ``FocusVocab`` by default,
    ``VocabCache(FindVocab.from_tokenizer)`` for the find constraint (``constrain_find``)."""

    def __init__(self, build: Callable[[Any], Any] | None = None) -> None:
        self._build = build or FocusVocab.from_tokenizer
        # keyed by id(); the tokenizer is held so its id cannot be reused
        self._entries: dict[int, tuple[Any, Any]] = {}

    def get(self, tokenizer: Any) -> Any:
        entry = self._entries.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, self._build(tokenizer))
            self._entries[id(tokenizer)] = entry
        return entry[1]


@dataclass
class ConstraintStats:
    """What the constraint did in one response, for the run record.

    ``steps``: steps taken inside a declaration; ``changed``: output indices where the
    mask moved the argmax (with greedy decoding, where it changed the output);
    ``unmasked``: steps left alone because no candidate survived.
    """

    steps: int = 0
    changed: list[int] = field(default_factory=list)
    unmasked: int = 0

    def record(self, index: int, masked: bool, changed: bool) -> None:
        """One step inside a declaration: masked (or left alone because nothing allowed
        survived), and whether the mask moved the argmax."""
        self.steps += 1
        if not masked:
            self.unmasked += 1
        elif changed:
            self.changed.append(index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "changed_argmax": list(self.changed),
            "unmasked": self.unmasked,
        }


class TokenConstraint(Protocol):
    """What a request's logits are restricted to, given the tag reader's pending text:
    ``allowed`` ids (a list, or an int64 array kept between steps), or ``None`` outside
    the constraint's declaration. Torch-free: ``declattn.api.constrained`` applies it to
    a logits row and records what it did in ``stats``."""

    stats: ConstraintStats

    def allowed_ids(self, pending: str) -> Sequence[int] | np.ndarray | None: ...


class FocusConstraint:
    """Masks a logits row so the focus tag being written can only become a valid one."""

    def __init__(self, vocab: FocusVocab, n_chunks: int) -> None:
        self.vocab = vocab
        self.n_chunks = n_chunks
        self.stats = ConstraintStats()

    def allowed_ids(self, pending: str) -> list[int] | None:
        """Token ids that may come next; None outside a focus-id declaration."""
        return self.vocab.allowed(pending, self.n_chunks)

