"""Streaming reader of the declarations a model writes in its output.

The reader is fed the model's output text in deltas of any size (one token's text, a
word, a whole response) and turns it into declarations with their character offsets.
Splitting the same output differently never changes the result: every decision is
taken only once the text that decides it has arrived, and never revised.

It sees only output text. There is deliberately no way to feed it prompt or context
text: tag-like text in a document must never change what the engine reads.

Recognition
    A tag candidate starts at ``<``, then an optional ``/``, then one of the names
    ``global``, ``focus``, ``local``, ``answer``, followed by ``>`` or a space/tab; it
    contains no ``<``, newline or carriage return, and ends at the first ``>`` within
    ``MAX_TAG_LEN`` characters (``MAX_FIND_TAG_LEN`` for a candidate that starts
    ``<focus find=``: a phrase needs more room than a list of ids). Anything else
    (``<focused>``, ``<b>``, ``a < b``, an overlong candidate) is plain text. A candidate
    that is well formed for its name is accepted; one that is not (``<focus>``,
    ``<local junk>``, ``magic_chunks="a"``) is declined.

Focus forms
    ``<focus magic_chunks="K">`` names 1 to ``MAX_FOCUS_IDS`` chunk ids.
    ``<focus find="WORDS">`` (or ``'WORDS'``) names them by content: the reader resolves
    WORDS against the chunk texts the moment the tag closes (``protocol/find.py``), so a
    reader built without a ``PhraseFinder`` declines every find. Both attributes in one
    tag are declined.

Answer under focus
    An ``<answer>`` opened inside an open focus block keeps that focus's chunk ids: the
    answer is written from the chunk the model focused on (mode ``ANSWER`` with ids);
    elsewhere ``<answer>`` reads what ``<local>`` reads.

Decline
    On any doubt the reader declines, and a decline leaves the request in global: a
    wrong narrow scope corrupts the answer, a refused one only costs reads.

Hold-back
    ``safe_end`` is the offset up to which the output is decided. Text from there on
    is a candidate that may still become a tag; a streaming front end holds it back
    so that a tag is never shown half-written, and releases it the moment it is
    decided (as a tag, or as plain text).

Line-start rule (``line_start=True``, off by default)
    An opening tag counts only at the very start of the output or right after a
    newline, so a model quoting ``<focus magic_chunks="2">`` mid-sentence does not
    narrow its own scope. Closing tags count anywhere: they only widen what is read.
    The rule is strict: an opening tag right after another tag on the same line
    (``</focus><answer>``) is plain text under it.

Offsets are Python string indices (code points) into the concatenated output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from declattn.protocol.grammar import (
    MAX_FIND_TAG_LEN,
    MAX_FOCUS_IDS,
    MAX_TAG_LEN,
    DeclineReason,
)
from declattn.protocol.modes import Mode

if TYPE_CHECKING:
    from declattn.protocol.find import PhraseFinder

TAG_NAMES: tuple[str, ...] = ("global", "focus", "local", "answer")
_SPACE = " \t"
_BREAKS = "<\n\r"  # never inside a candidate
_LONGEST_NAME = max(len(n) for n in TAG_NAMES)

_SIMPLE_RE = re.compile(r"<(/?)(global|focus|local|answer)[ \t]*>")
_FOCUS_RE = re.compile(
    r"<focus[ \t]+magic_chunks[ \t]*=[ \t]*"
    r"(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>[0-9][0-9 \t,]*?))"
    r"[ \t]*>"
)
_IDS_RE = re.compile(r"[ \t]*[0-9]+[ \t]*(?:,[ \t]*[0-9]+[ \t]*)*")
_IN_IDS_RE = re.compile(
    r"<focus[ \t]+magic_chunks[ \t]*=[ \t]*(?:[\"'][0-9, \t]*|[0-9][0-9, \t]*)?"
)
_FIND_HEAD_RE = re.compile(r"<focus[ \t]+find[ \t]*=")
_FIND_RE = re.compile(
    r"<focus[ \t]+find[ \t]*=[ \t]*(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)')[ \t]*>"
)
_ATTR = r"[ \t]+([A-Za-z_]+)[ \t]*=[ \t]*(?:\"[^\"]*\"|'[^']*'|[^ \t\"'>]*)"  # name=value
_ATTR_RE = re.compile(_ATTR)
_ATTRS_RE = re.compile(rf"<focus((?:{_ATTR})+)[ \t]*>")

_OPEN_MODE = {"global": Mode.GLOBAL, "local": Mode.LOCAL, "answer": Mode.ANSWER}


@dataclass(frozen=True)
class Declaration:
    """One tag the model wrote, accepted or declined.

    ``mode`` and ``focus_ids`` are the reader's state right after this tag (a declined
    tag leaves global and no ids); the ids the model asked for are in ``tag``.
    ``declined`` is a ``DeclineReason`` (a ``str``) or ``None`` if accepted.

    For a find tag, ``phrase`` is the attribute value as written and ``match`` the
    ``MatchQuality`` (``"exact"`` or ``"window"``) of what it resolved to, also when the
    focus was declined for another reason (too many chunks, not in global); the
    resolved ids are ``focus_ids``, best match first. Both are ``None`` for other tags.
    """

    kind: str
    start: int
    end: int
    tag: str
    focus_ids: tuple[int, ...]
    mode: Mode
    declined: str | None = None
    phrase: str | None = None
    match: str | None = None

    @property
    def accepted(self) -> bool:
        return self.declined is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "start": self.start,
            "end": self.end,
            "tag": self.tag,
            "focus_ids": list(self.focus_ids),
            "mode": str(self.mode),
            "declined": None if self.declined is None else str(self.declined),
            "phrase": self.phrase,
            "match": None if self.match is None else str(self.match),
        }


class _Status(Enum):
    PARTIAL = 0  # may still become a tag: hold it back
    PLAIN = 1  # can no longer be a tag
    COMPLETE = 2  # a whole candidate, ending at a '>'


def _classify(s: str, closing_only: bool) -> tuple[_Status, int]:
    """Decide what the text ``s`` (starting at a ``<``) is, as far as it goes.

    A PLAIN or COMPLETE answer never changes when more text is appended, which is
    what makes the reader independent of how the output is split.
    """
    if len(s) == 1:
        return _Status.PARTIAL, 0
    i = 1
    if s[1] == "/":
        i = 2
    elif closing_only:
        return _Status.PLAIN, 0
    rest = s[i : i + _LONGEST_NAME + 1]
    name = None
    could_be = False
    for n in TAG_NAMES:
        if rest.startswith(n):
            if len(rest) == len(n):
                return _Status.PARTIAL, 0
            if rest[len(n)] == ">" or rest[len(n)] in _SPACE:
                name = n
            break
        if n.startswith(rest):
            could_be = True
    if name is None:
        return (_Status.PARTIAL if could_be else _Status.PLAIN), 0
    # The head decides the limit, and it lies within MAX_TAG_LEN: a candidate is judged
    # by the same limit however much of it has arrived.
    finding = _FIND_HEAD_RE.match(s, 0, MAX_TAG_LEN) is not None
    limit = MAX_FIND_TAG_LEN if finding else MAX_TAG_LEN
    for pos in range(i + len(name), min(len(s), limit)):
        ch = s[pos]
        if ch == ">":
            return _Status.COMPLETE, pos + 1
        if ch in _BREAKS:
            return _Status.PLAIN, 0
    return (_Status.PLAIN if len(s) >= limit else _Status.PARTIAL), 0


def _parse_focus_ids(tag: str) -> tuple[int, ...] | None:
    """The ids of a well-formed opening focus tag, sorted and unique; None if malformed."""
    m = _FOCUS_RE.fullmatch(tag)
    if m is None:
        return None
    value = next(v for v in (m["dq"], m["sq"], m["bare"]) if v is not None)
    if _IDS_RE.fullmatch(value) is None:
        return None
    return tuple(sorted({int(part) for part in value.split(",")}))


def _attribute_names(tag: str) -> list[str]:
    """The attribute names of an opening focus tag, as written; [] if it has no
    attribute list of the ``name=value`` kind."""
    m = _ATTRS_RE.fullmatch(tag)
    return [] if m is None else _ATTR_RE.findall(m[1])


class TagReader:
    """Turns streamed output text into declarations and the current mode.

    ``n_chunks`` is the number of magic chunks in the prompt (ids ``1..n_chunks``);
    ``finder`` resolves find phrases against those chunks' texts (without one, every
    find is declined). See the module docstring for the grammar, the hold-back and the
    line-start rule.
    """

    def __init__(
        self, n_chunks: int, line_start: bool = False, *, finder: PhraseFinder | None = None
    ) -> None:
        if n_chunks < 0:
            raise ValueError(f"n_chunks must be >= 0, got {n_chunks}")
        if finder is not None and finder.n_chunks != n_chunks:
            raise ValueError(
                f"the phrase finder holds {finder.n_chunks} chunk texts for {n_chunks} chunks"
            )
        self._n_chunks = n_chunks
        self._finder = finder
        self._line_start = line_start
        self._mode = Mode.GLOBAL
        self._focus_ids: tuple[int, ...] = ()
        self._pending = ""
        self._safe_end = 0
        self._text_len = 0
        self._prev_char: str | None = None  # last decided character, None at the start
        self._untaken: list[str] = []
        self._declarations: list[Declaration] = []
        self._finished = False

    # -- state -------------------------------------------------------------------------

    @property
    def n_chunks(self) -> int:
        return self._n_chunks

    @property
    def line_start(self) -> bool:
        return self._line_start

    @property
    def finder(self) -> PhraseFinder | None:
        return self._finder

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def focus_ids(self) -> tuple[int, ...]:
        """The focused chunk ids: those of a focus, or of the focus an answer was opened
        in; empty otherwise."""
        return self._focus_ids

    @property
    def safe_end(self) -> int:
        """Offset up to which the output is decided and may be shown."""
        return self._safe_end

    @property
    def pending(self) -> str:
        """The undecided tail ``output[safe_end:]``: a candidate that may become a tag."""
        return self._pending

    @property
    def text_len(self) -> int:
        """Characters fed so far."""
        return self._text_len

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def declarations(self) -> tuple[Declaration, ...]:
        """Every declaration so far, accepted and declined, in output order."""
        return tuple(self._declarations)

    @property
    def declines(self) -> tuple[Declaration, ...]:
        """The declined declarations so far."""
        return tuple(d for d in self._declarations if d.declined is not None)

    @property
    def inside_chunk_ids(self) -> bool:
        """True while the pending text is an opening focus tag past ``magic_chunks=``
        whose id list is not closed yet, i.e. the next characters should be ids,
        commas, spaces, a closing quote or ``>``. A sampler may use this to constrain
        what the model writes there."""
        return _IN_IDS_RE.fullmatch(self._pending) is not None

    # -- input -------------------------------------------------------------------------

    def feed(self, text: str) -> list[Declaration]:
        """Read one delta of output; return the tags it completed, in order."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not isinstance(text, str):
            raise TypeError(f"feed() takes str, got {type(text).__name__}")
        if not text:
            return []
        self._text_len += len(text)
        buf = self._pending + text
        base = self._safe_end
        found: list[Declaration] = []
        pos = 0
        while True:
            lt = buf.find("<", pos)
            if lt < 0:
                pos = len(buf)
                break
            prev = buf[lt - 1] if lt > 0 else self._prev_char
            closing_only = self._line_start and prev is not None and prev != "\n"
            status, end = _classify(buf[lt : lt + MAX_FIND_TAG_LEN], closing_only)
            if status is _Status.PARTIAL:
                pos = lt
                break
            if status is _Status.PLAIN:
                pos = lt + 1
                continue
            end += lt
            found.append(self._declare(buf[lt:end], base + lt, base + end))
            pos = end
        self._decide(buf[:pos])
        self._pending = buf[pos:]
        self._declarations.extend(found)
        return found

    def finish(self) -> list[Declaration]:
        """End of stream: the pending text can no longer become a tag; release it."""
        if not self._finished:
            self._decide(self._pending)
            self._pending = ""
            self._finished = True
        return []

    def take_text(self) -> str:
        """The output decided since the last call (tags included, as written).

        Joined over a whole stream, the pieces equal the output exactly. Untaken text
        accumulates, so a streaming caller takes it after every feed.
        """
        text = "".join(self._untaken)
        self._untaken.clear()
        return text

    # -- internals ---------------------------------------------------------------------

    def _decide(self, text: str) -> None:
        if text:
            self._untaken.append(text)
            self._safe_end += len(text)
            self._prev_char = text[-1]

    def _declare(self, tag: str, start: int, end: int) -> Declaration:
        closing = tag[1] == "/"
        name = tag[2:] if closing else tag[1:]
        name = next(n for n in TAG_NAMES if name.startswith(n))
        kind = "/" + name if closing else name
        reason: DeclineReason | None = None
        mode, ids = Mode.GLOBAL, ()
        if closing or name != "focus":
            if _SIMPLE_RE.fullmatch(tag) is None:
                reason = DeclineReason.BAD_SYNTAX
            elif not closing:
                mode = _OPEN_MODE[name]
                if mode is Mode.ANSWER and self._mode is Mode.FOCUS:
                    ids = self._focus_ids  # an answer inside a focus reads that focus
        elif {"find", "magic_chunks"} <= set(_attribute_names(tag)):
            reason = DeclineReason.FIND_AND_IDS
        elif (found := _FIND_RE.fullmatch(tag)) is not None:
            phrase = found["dq"] if found["dq"] is not None else found["sq"]
            return self._declare_find(tag, start, end, phrase)
        else:
            parsed = _parse_focus_ids(tag)
            if parsed is None:
                reason = DeclineReason.BAD_SYNTAX
            elif len(parsed) > MAX_FOCUS_IDS:
                reason = DeclineReason.TOO_MANY_IDS
            elif any(not 1 <= i <= self._n_chunks for i in parsed):
                reason = DeclineReason.UNKNOWN_ID
            elif self._mode is not Mode.GLOBAL:
                reason = DeclineReason.NOT_IN_GLOBAL
            else:
                mode, ids = Mode.FOCUS, parsed
        self._mode, self._focus_ids = mode, ids
        return Declaration(kind, start, end, tag, ids, mode, reason)

    def _declare_find(self, tag: str, start: int, end: int, phrase: str) -> Declaration:
        reason: DeclineReason | None
        mode, ids, match = Mode.GLOBAL, (), None
        if self._finder is None:
            reason = DeclineReason.NO_CHUNK_TEXTS
        else:
            res = self._finder.resolve(phrase)
            reason, match = res.declined, res.quality
            if reason is None and self._mode is not Mode.GLOBAL:
                reason = DeclineReason.NOT_IN_GLOBAL
            if reason is None:
                mode, ids = Mode.FOCUS, res.ids
        self._mode, self._focus_ids = mode, ids
        return Declaration("focus", start, end, tag, ids, mode, reason, phrase, match)
