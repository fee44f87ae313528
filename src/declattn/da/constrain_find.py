"""Constrained find declarations: a phrase can only be written as text some chunk holds.

While ``<focus find="WORDS">`` is written, WORDS may only grow into text that occurs in
the chunks: after folding (``protocol.find.fold``), the phrase so far must be a prefix
of the folded context read from a word start. The closing quote is allowed wherever the
phrase so far ends on a whole word of such an occurrence, i.e. exactly where the reader
would resolve it as an exact match; it is never withheld because the phrase is still in
too many chunks (that is the reader's ambiguous decline, not a trap). Before the quote
the tag may only be ``=`` and spaces; after it, spaces and ``>``. Tokens with no text are
masked inside the tag, as in the id constraint (``constrain.py``), whose interface this
one shares, so a session may apply both.

Folding works character by character, so a token's effect on the folded phrase is its
own folded text (its "form") joined at one separator: the vocabulary is folded once per
tokenizer (``FindVocab``), and each step looks up forms among the continuations the
context has at the phrase's occurrences (``PhraseFinder``, one per request). The
candidates after a phrase are cached, so a step costs a lookup once the phrase has been
seen.

Tokens whose text is an incomplete character (byte-level BPE pieces of a multibyte
character) are never allowed inside a phrase: the detokenizer holds them back, so the
constraint could not see what they add. A phrase character that a tokenizer spells only
across tokens cannot be written under the constraint.

Like ``constrain.py`` this is torch-free: ``declattn.api.constrained`` masks the logits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from declattn.da.constrain import ConstraintStats, tag_part, token_texts
from declattn.protocol.find import PhraseFinder, fold
from declattn.protocol.grammar import MAX_FIND_TAG_LEN, MAX_FIND_WORDS

_HEAD_RE = re.compile(r"<focus[ \t]+find")
_REFERENCE = '<focus find="the'
"""Tokens are decoded after a word inside a phrase, where they matter."""
_QUOTES = ('"', "'")
_AFTER_QUOTE_RE = re.compile(r"[ \t]*>?")
_NOT_IN_TAG = frozenset("<\n\r\ufffd")


class _Phase(Enum):
    NAME = 0  # after "find": spaces, then "="
    EQ = 1  # after "=": spaces, then the opening quote
    PHRASE = 2  # inside the value
    CLOSED = 3  # after the closing quote: spaces, then ">"
    DEAD = 4  # no valid find tag starts this way


def in_find_declaration(pending: str) -> bool:
    """Whether the reader's pending text is a find focus tag past ``<focus find``."""
    return _HEAD_RE.match(pending) is not None


def _join(phrase: str, form: str) -> str:
    """The folded phrase after appending a piece whose folded text is ``form``."""
    if not phrase or phrase.endswith(" "):
        return phrase + form.lstrip(" ")
    return phrase + form


@dataclass(frozen=True)
class _FindState:
    phase: _Phase
    quote: str = ""
    phrase: str = ""  # folded, without a leading separator


def _find_state(pending: str) -> _FindState | None:
    m = _HEAD_RE.match(pending)
    if m is None:
        return None
    rest = pending[m.end() :]
    i = len(rest) - len(rest.lstrip(" \t"))
    if i == len(rest):
        return _FindState(_Phase.NAME)
    if rest[i] != "=":
        return _FindState(_Phase.DEAD)
    body = rest[i + 1 :].lstrip(" \t")
    if not body:
        return _FindState(_Phase.EQ)
    quote, body = body[0], body[1:]
    if quote not in _QUOTES:
        return _FindState(_Phase.DEAD)
    if quote in body:
        after = body[body.index(quote) + 1 :]
        closed = not after.strip(" \t")
        return _FindState(_Phase.CLOSED, quote) if closed else _FindState(_Phase.DEAD)
    return _FindState(_Phase.PHRASE, quote, fold(body).lstrip(" "))


def closing_at_one_chunk(pending: str, finder: PhraseFinder) -> str | None:
    """The closing quote and ``>`` of the find tag ``pending`` where its phrase already
    names one chunk for good; ``None`` elsewhere.

    That is when the phrase so far is whole words at every place it occurs in the chunks
    (no occurrence goes on inside its last word) and resolves as an exact match to one
    chunk. Under the find constraint every longer phrase is one of those occurrences
    grown by more words, so more words could not move the focus to another chunk (at
    most add the next one, where the phrase would run across the boundary): the words
    after this point cost a decode step each and buy nothing."""
    state = _find_state(pending)
    if state is None or state.phase is not _Phase.PHRASE:
        return None
    phrase = state.phrase.rstrip(" ")
    if not phrase or not finder.names_one_chunk(phrase):
        return None
    return state.quote + ">"


def _finish_cost(phrase: str, finder: PhraseFinder) -> int:
    """Characters still needed after the folded ``phrase``: the rest of its last word (or
    a whole word, with none yet) and the closing quote and ``>``. Counted in folded
    characters, which a token spells at least one for one in practice, so a phrase is
    never let grow where it could no longer be closed within the length limit."""
    return 2 + finder.word_rest(phrase)


def phrase_piece_ok(
    quote: str, phrase: str, piece: str, used: int, finder: PhraseFinder
) -> bool:
    """Whether ``piece`` (a token's tag part) may follow the folded ``phrase`` inside a
    find value opened with ``quote``, in a tag of ``used`` characters so far: the
    reference check, which ``FindVocab.allowed`` must agree with."""
    if _NOT_IN_TAG & set(piece):
        return False
    total = used + len(piece)
    if quote in piece:
        content, after = piece.split(quote, 1)
        if _AFTER_QUOTE_RE.fullmatch(after) is None:
            return False
        done = _join(phrase, fold(content)).rstrip(" ")
        return (
            1 <= len(done.split()) <= MAX_FIND_WORDS
            and finder.occurs(done + " ")
            and total + (0 if after.endswith(">") else 1) <= MAX_FIND_TAG_LEN
        )
    if ">" in piece:
        return False  # a ">" inside the value ends the tag: bad syntax
    grown = _join(phrase, fold(piece))
    return (
        len(grown.split()) <= MAX_FIND_WORDS
        and (not grown or finder.occurs(grown))
        and total + _finish_cost(grown, finder) <= MAX_FIND_TAG_LEN
    )


def find_piece_ok(pending: str, piece: str, finder: PhraseFinder) -> bool:
    """Whether writing ``piece`` (a token's tag part) after ``pending`` keeps the find
    tag on a path to an exact, resolvable phrase; the reference for ``FindVocab``."""
    state = _find_state(pending)
    return state is not None and _piece_ok(state, len(pending), piece, finder)


def _piece_ok(state: _FindState, used: int, piece: str, finder: PhraseFinder) -> bool:
    if not piece or _NOT_IN_TAG & set(piece):
        return False
    phase, i = state.phase, 0
    while phase in (_Phase.NAME, _Phase.EQ) and i < len(piece):
        ch = piece[i]
        i += 1
        if ch in " \t":
            continue
        if phase is _Phase.NAME and ch == "=":
            phase = _Phase.EQ
        elif phase is _Phase.EQ and ch in _QUOTES:
            return phrase_piece_ok(ch, "", piece[i:], used + i, finder)
        else:
            return False
    if phase in (_Phase.NAME, _Phase.EQ):
        # "=", the quotes, ">" and the shortest word are still to come
        rest = (4 if phase is _Phase.NAME else 3) + finder.word_rest("")
        return used + len(piece) + rest <= MAX_FIND_TAG_LEN
    if phase is _Phase.PHRASE:
        return phrase_piece_ok(state.quote, state.phrase, piece, used, finder)
    if phase is _Phase.CLOSED:
        ok = _AFTER_QUOTE_RE.fullmatch(piece) is not None
        return ok and used + len(piece) + (0 if piece.endswith(">") else 1) <= MAX_FIND_TAG_LEN
    return False


@dataclass(frozen=True)
class _Group:
    """Tokens that act alike inside a find phrase, and the longest of their tag parts."""

    ids: tuple[int, ...]
    longest: int


@dataclass
class _Candidates:
    """The tokens allowed after one phrase, in groups that leave the same phrase (or the
    same closing), so the usual step, far from the length limit, only joins lists."""

    ids: list[int] = field(default_factory=list)
    # (group, the phrase it leaves or None for a closing, characters a closing still needs)
    groups: list[tuple[_Group, str | None, int]] = field(default_factory=list)
    longest: int = 0  # the longest tag part over all groups
    _array: np.ndarray | None = None  # ``ids`` as an int64 array, made on first use

    def add(self, group: _Group, grown: str | None, finish: int = 0) -> None:
        self.ids.extend(group.ids)
        self.groups.append((group, grown, finish))
        self.longest = max(self.longest, group.longest)

    def fits_all(self, room: int, finder: PhraseFinder) -> bool:
        return self.longest + 2 + finder.longest_word <= room

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.asarray(self.ids, dtype=np.int64)
        return self._array

    def fitting(self, room: int, parts: Mapping[int, str], finder: PhraseFinder) -> list[int]:
        """The tokens whose tag part, and what must still follow it, fit in ``room``."""
        if self.fits_all(room, finder):
            return list(self.ids)
        out: list[int] = []
        for g, grown, finish in self.groups:
            need = finish if grown is None else _finish_cost(grown, finder)
            if g.longest + need <= room:
                out.extend(g.ids)
            else:
                out.extend(i for i in g.ids if len(parts[i]) + need <= room)
        return out


class FindVocab:
    """A tokenizer's vocabulary sorted by what each token can do inside a find tag.

    Built once per tokenizer (every token decoded and folded). Inside the phrase, a
    token counts by its form: the folded text of its tag part (up to its first ``>``).
    """

    def __init__(self, parts: Mapping[int, str]) -> None:
        self.parts: dict[int, str] = {}
        opened: dict[str, dict[str, list[int]]] = {q: {} for q in _QUOTES}
        closed: dict[str, dict[tuple[str, int], list[int]]] = {q: {} for q in _QUOTES}
        self._head: list[int] = []  # may be written before the opening quote
        self._after: list[int] = []  # may be written after the closing quote
        forms: set[str] = set()
        for token_id, part in sorted(parts.items()):
            if not part or _NOT_IN_TAG & set(part):
                continue
            self.parts[token_id] = part
            if part.lstrip(" \t=")[:1] in ("", *_QUOTES):
                self._head.append(token_id)
            if _AFTER_QUOTE_RE.fullmatch(part):
                self._after.append(token_id)
            form = None if part.endswith(">") else fold(part)
            for q in _QUOTES:
                if q in part:
                    content, after = part.split(q, 1)
                    if _AFTER_QUOTE_RE.fullmatch(after):
                        finish = 0 if after.endswith(">") else 1
                        closed[q].setdefault((fold(content), finish), []).append(token_id)
                elif form is not None:
                    opened[q].setdefault(form, []).append(token_id)
                    forms.add(form)
        stems = {""}
        for form in forms:
            for f in (form, form.lstrip(" ")):
                stems.update(f[:j] for j in range(1, len(f) + 1))
        self._stems = frozenset(stems)  # every prefix of an open form, with and without
        # its leading separator (after a separator, " x" adds what "x" adds)
        made: dict[tuple[int, ...], _Group] = {}  # the two quotes share most groups

        def group(ids: list[int]) -> _Group:
            key = tuple(ids)
            if key not in made:
                made[key] = _Group(key, max(len(self.parts[i]) for i in key))
            return made[key]

        # per quote: form -> the tokens of that form; content form -> (tokens, finish)
        self._open = {q: {f: group(ids) for f, ids in t.items()} for q, t in opened.items()}
        self._close: dict[str, dict[str, list[tuple[_Group, int]]]] = {q: {} for q in opened}
        for q, t in closed.items():
            for (content, finish), ids in t.items():
                self._close[q].setdefault(content, []).append((group(ids), finish))
        self._longest = max((len(f) for t in self._open.values() for f in t), default=0)

    @classmethod
    def from_texts(cls, texts: Mapping[int, str]) -> FindVocab:
        """From each token's text as written mid-phrase."""
        return cls({i: tag_part(t) for i, t in texts.items()})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> FindVocab:
        return cls.from_texts(token_texts(tokenizer, _REFERENCE))

    def candidates(self, quote: str, phrase: str, finder: PhraseFinder) -> _Candidates:
        """Every token that keeps the folded ``phrase`` resolvable, ignoring the tag's
        length: the costly part of a step, a pure function of its arguments
        (``FindConstraint`` caches it)."""
        at_sep = not phrase or phrase.endswith(" ")
        prefixes = self._stems_along(sorted(finder.continuations(phrase, self._longest)))
        out = _Candidates()
        table = self._open[quote]
        words = len(phrase.split())
        for stem in prefixes:
            grown = phrase + stem
            # a stem adds at most one word more than it has separators
            if words + stem.count(" ") + 1 > MAX_FIND_WORDS:
                if len(grown.split()) > MAX_FIND_WORDS:
                    continue
            for form in (stem, " " + stem) if at_sep else (stem,):
                group = table.get(form)
                if group is not None:
                    out.add(group, grown)
        for content, groups in self._close[quote].items():
            done = _join(phrase, content).rstrip(" ")
            if 1 <= len(done.split()) <= MAX_FIND_WORDS and finder.occurs(done + " "):
                for group, finish in groups:
                    out.add(group, None, finish)
        return out

    def _stems_along(self, conts: list[str]) -> set[str]:
        """Every prefix of the sorted strings ``conts`` that is a prefix of some form.

        Walked as a trie: a string shares its first characters with the one before, and
        whatever those decided (added, or the walk stopped there) holds for it too."""
        stems = self._stems
        found = {""} if conts else set()  # "" (a token adding nothing) if the phrase occurs
        prev, reach = "", 0  # prev[:reach] is the longest prefix of prev among the stems
        for cont in conts:
            n = min(len(prev), len(cont), reach + 1)
            common = 0
            while common < n and prev[common] == cont[common]:
                common += 1
            if common > reach:
                continue  # it shares prev[:reach + 1], which is no stem: nothing new
            j = common
            while j < len(cont) and cont[: j + 1] in stems:
                j += 1
                found.add(cont[:j])
            prev, reach = cont, j
        return found

    def _cached(
        self, state: _FindState, finder: PhraseFinder, cache: dict[Any, Any] | None
    ) -> _Candidates:
        key = (state.quote, state.phrase)
        found = None if cache is None else cache.get(key)
        if found is None:
            found = self.candidates(state.quote, state.phrase, finder)
            if cache is not None:
                cache[key] = found
        return found

    def allowed_index(
        self, pending: str, finder: PhraseFinder, cache: dict[Any, Any]
    ) -> list[int] | np.ndarray | None:
        """``allowed``, as a cached array on a phrase step, so a step does not rebuild
        the index of thousands of ids: all the candidates far from the length limit,
        else those that fit the room left (the first word of a long vocabulary's phrase
        included: its longest tokens do not fit)."""
        state = _find_state(pending)
        if state is None or state.phase is not _Phase.PHRASE:
            return self.allowed(pending, finder, cache)
        found = self._cached(state, finder, cache)
        room = MAX_FIND_TAG_LEN - len(pending)
        if found.fits_all(room, finder):
            return found.array()
        key = ("fitting", state.quote, state.phrase, room)
        if key not in cache:
            cache[key] = np.asarray(found.fitting(room, self.parts, finder), dtype=np.int64)
        return cache[key]

    def allowed(
        self, pending: str, finder: PhraseFinder, cache: dict[Any, Any] | None = None
    ) -> list[int] | None:
        """Token ids that may come next; None when ``pending`` is not in a find tag."""
        state = _find_state(pending)
        if state is None:
            return None
        used = len(pending)
        if state.phase is _Phase.PHRASE:
            found = self._cached(state, finder, cache)
            return found.fitting(MAX_FIND_TAG_LEN - used, self.parts, finder)
        if state.phase is _Phase.DEAD:
            return []
        pool = self._after if state.phase is _Phase.CLOSED else self._head
        return [i for i in pool if _piece_ok(state, used, self.parts[i], finder)]


class FindConstraint:
    """Masks a logits row so a find phrase can only continue as text found in a chunk.

    One per request: ``finder`` holds that request's chunk texts. ``prepare()`` builds the
    prefix index and the first step's candidates up front (else the first find tag pays).
    ``close_at_one_chunk``: a phrase that names one chunk for good may only be closed
    (``closing_at_one_chunk``), so a caller without jump-forward writes the close the
    engine would append.
    """

    def __init__(self, vocab: FindVocab, finder: PhraseFinder, *,
                 close_at_one_chunk: bool = False) -> None:
        self.vocab = vocab
        self.finder = finder
        self.close_at_one_chunk = close_at_one_chunk
        self.stats = ConstraintStats()
        self._cache: dict[Any, Any] = {}

    def _closing(self, pending: str) -> np.ndarray | None:
        """The tokens that start the due close, where one is due."""
        close = closing_at_one_chunk(pending, self.finder) if self.close_at_one_chunk else None
        if close is None:
            return None
        key = ("close", close)
        if key not in self._cache:
            ids = [i for i, part in self.vocab.parts.items() if close.startswith(part)]
            self._cache[key] = np.asarray(ids, dtype=np.int64)
        return self._cache[key]

    def prepare(self) -> None:
        """Build the finder's prefix index and the candidates right after ``find="`` (the
        costliest step: every word start is a continuation). ``find='`` is left to first
        use: models copy the double quote of the instruction."""
        self.finder.prepare()
        self.vocab.allowed_index('<focus find="', self.finder, self._cache)

    def allowed(self, pending: str) -> list[int] | None:
        """Token ids that may come next; None outside a find tag."""
        closing = self._closing(pending)
        if closing is not None:
            return closing.tolist()
        return self.vocab.allowed(pending, self.finder, self._cache)

    def allowed_ids(self, pending: str) -> list[int] | np.ndarray | None:
        """``allowed``, as a cached array on most steps (what a logits row is masked with)."""
        closing = self._closing(pending)
        if closing is not None:
            return closing
        return self.vocab.allowed_index(pending, self.finder, self._cache)
