"""Content-addressed focus: which magic chunks hold the words a model asked for.

``<focus find="WORDS">`` lets a model say *what* it wants to read instead of *where*.
Small models copy words well but do not navigate by chunk number, so the engine does the
lookup: the phrase is folded (see ``fold``) and searched in the chunk texts, folded the
same way, as

1. an exact phrase: its words, consecutive, in order (whole words: ``train`` does not
   match ``trains``);
2. failing that, all its words (a repeated one as often) within a window of
   ``len(words) + WINDOW_SLACK`` consecutive words, in any order.

The chunks holding a match of the best kind found are the focus, ranked by how many
matches each holds, then by the tightest window, then by id. More than
``MAX_FOCUS_IDS`` of them, none, an empty phrase or one over ``MAX_FIND_WORDS`` words is
a decline: on any doubt the request stays in global.

The whole context is one word sequence (the chunks in order), so a phrase that runs
across a chunk boundary names both chunks.

Everything is a pure function of the phrase and the chunk texts: the live reader and a
replay from the recorded chunk texts resolve the same phrase to the same chunks.
The same folded text also serves the decoding constraint (``declattn.da.constrain``), which
asks which continuations of a phrase occur at a word start (``continuations``), so that
what the constraint lets a model write is what this module resolves as exact.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from declattn.protocol.grammar import MAX_FIND_WORDS, MAX_FOCUS_IDS, DeclineReason

WINDOW_SLACK = 8
"""The fallback window spans at most ``len(words) + WINDOW_SLACK`` words."""

_KEY_LEN = 64  # characters of each word-start suffix kept sorted for prefix search

# Apostrophes are deleted, not turned into separators: "O'Brien", "O’Brien" and
# "OBrien" are one word, and "Leeds’s" is "leedss" on both sides of the match.
_APOSTROPHES = frozenset("'\u2019\u2018\u201b\u02bc\u02bb\u0060\u00b4\u2032\uff07")
_CJK = (
    (0x3040, 0x30FF),  # hiragana, katakana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0x20000, 0x3FFFF),  # CJK extensions B onwards
)
_RUNS = re.compile(" {2,}")


class MatchQuality(StrEnum):
    """How a find phrase matched the chunks it resolved to."""

    EXACT = "exact"
    WINDOW = "window"


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK)


def _fold_char(ch: str) -> str:
    """One character, folded: word characters kept, apostrophes and format characters
    dropped, everything else a separator. A pure function of the character, so folding
    a text piece by piece equals folding it whole (the constraint depends on that)."""
    if ch in _APOSTROPHES:
        return ""
    out = []
    for d in unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", ch).casefold()):
        cat = unicodedata.category(d)
        if d in _APOSTROPHES or cat == "Cf":
            continue
        if cat[0] in "LNM":
            out.append(f" {d} " if _is_cjk(d) else d)
        else:
            out.append(" ")
    return "".join(out)


class _FoldTable(dict[int, str]):
    """``str.translate`` table filled on first sight of each character."""

    def __missing__(self, code: int) -> str:
        out = _fold_char(chr(code))
        self[code] = out
        return out


_TABLE = _FoldTable()


def fold(text: str) -> str:
    """``text`` folded for matching, separators kept as single spaces (also at the ends).

    Per character: compatibility decomposition (NFKD: ``ﬁ`` is ``fi``, full-width ``Ａ`` is
    ``a``, accents become combining marks, kept), case folding (``Straße`` is
    ``strasse``); letters, digits and marks are word characters; every apostrophe
    (``'`` ``’`` ``‘`` ``ʼ`` and kin) and format character (soft hyphen, zero-width space)
    is dropped; each CJK ideograph or kana is a word of its own (those scripts put no
    spaces between words); anything else (whitespace, punctuation, quotes of every kind,
    symbols) separates words.
    """
    return _RUNS.sub(" ", text.translate(_TABLE))


def normalize(text: str) -> str:
    """The folded words of ``text`` joined by single spaces."""
    return fold(text).strip(" ")


def phrase_words(text: str) -> tuple[str, ...]:
    """The folded words of ``text``."""
    return tuple(normalize(text).split())


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolving one find phrase.

    ``ids``: the focused chunks, best first (empty when declined). ``matched``: every
    chunk holding a match of the best kind, ranked the same way, also when there are
    too many (that is the ambiguous decline). ``quality``: the kind of match, ``None``
    when none was found.
    """

    phrase: str
    words: tuple[str, ...]
    ids: tuple[int, ...]
    matched: tuple[int, ...]
    quality: MatchQuality | None
    declined: DeclineReason | None

    @property
    def accepted(self) -> bool:
        return self.declined is None


class PhraseFinder:
    """The chunk texts of one request, folded and indexed once, to resolve find phrases.

    ``chunk_texts[i]`` is magic chunk ``i + 1``. Build it from the same chunk texts the
    prompt was rendered from (the run record keeps them), never from the rendered
    prompt: only chunk bodies are searched, no scaffold.
    """

    def __init__(self, chunk_texts: Sequence[str]) -> None:
        words: list[str] = []
        chunk_of: list[int] = []
        for cid, text in enumerate(chunk_texts, 1):
            if not isinstance(text, str):
                raise TypeError(f"chunk {cid} text is {type(text).__name__}, not str")
            ws = normalize(text).split()
            words.extend(ws)
            chunk_of.extend([cid] * len(ws))
        self._n_chunks = len(chunk_texts)
        self._words = words
        self._chunk_of = chunk_of
        self._postings: dict[str, list[int]] = {}
        for i, w in enumerate(words):
            self._postings.setdefault(w, []).append(i)
        self.text = "".join(w + " " for w in words)
        """Every folded word followed by one space: what continuations are read from."""
        starts, at = [], 0
        for w in words:
            starts.append(at)
            at += len(w) + 1
        self._starts = starts
        self.longest_word = max(map(len, words), default=0)
        self._rest: dict[str, int] = {}
        self._one: dict[str, bool] = {}

    @property
    def n_chunks(self) -> int:
        return self._n_chunks

    @property
    def n_words(self) -> int:
        return len(self._words)

    # -- resolution ---------------------------------------------------------------------

    def resolve(self, phrase: str) -> Resolution:
        """Resolve the attribute value ``phrase`` (as written) to at most 3 chunks."""
        words = phrase_words(phrase)
        if not words:
            return Resolution(phrase, words, (), (), None, DeclineReason.EMPTY_PHRASE)
        if len(words) > MAX_FIND_WORDS:
            return Resolution(phrase, words, (), (), None, DeclineReason.PHRASE_TOO_LONG)
        quality = MatchQuality.EXACT
        hits = self._exact(words)
        if not hits:
            quality = MatchQuality.WINDOW
            hits = self._windows(words)
        if not hits:
            return Resolution(phrase, words, (), (), None, DeclineReason.NO_MATCH)
        count: dict[int, int] = {}
        best: dict[int, int] = {}
        for first, last in hits:
            for cid in range(self._chunk_of[first], self._chunk_of[last] + 1):
                count[cid] = count.get(cid, 0) + 1
                best[cid] = min(best.get(cid, last - first + 1), last - first + 1)
        ranked = tuple(sorted(count, key=lambda c: (-count[c], best[c], c)))
        if len(ranked) > MAX_FOCUS_IDS:
            return Resolution(phrase, words, (), ranked, quality, DeclineReason.AMBIGUOUS)
        return Resolution(phrase, words, ranked, ranked, quality, None)

    def _exact(self, words: tuple[str, ...]) -> list[tuple[int, int]]:
        """(first, last) word positions of every occurrence of ``words`` in order."""
        lists: list[list[int]] = []
        for w in words:
            posting = self._postings.get(w)
            if posting is None:
                return []
            lists.append(posting)
        k = min(range(len(words)), key=lambda j: len(lists[j]))  # the rarest word
        n = len(words)
        out = []
        for pos in lists[k]:
            first = pos - k
            if first >= 0 and tuple(self._words[first : first + n]) == words:
                out.append((first, first + n - 1))
        return out

    def _windows(self, words: tuple[str, ...]) -> list[tuple[int, int]]:
        """(first, last) of the shortest window ending at each word position that holds
        every word of ``words`` (as often as the phrase has it), spanning at most
        ``len(words) + WINDOW_SLACK`` words."""
        need: dict[str, int] = {}
        for w in words:
            need[w] = need.get(w, 0) + 1
        if any(w not in self._postings for w in need):
            return []
        events = sorted((p, w) for w in need for p in self._postings[w])
        limit = len(words) + WINDOW_SLACK
        have = dict.fromkeys(need, 0)
        short = len(need)  # words still below their count
        out = []
        left = 0
        for pos, w in events:
            have[w] += 1
            if have[w] == need[w]:
                short -= 1
            while have[events[left][1]] > need[events[left][1]]:  # not needed: drop it
                have[events[left][1]] -= 1
                left += 1
            first = events[left][0]
            if short == 0 and pos - first + 1 <= limit:
                out.append((first, pos))
        return out

    # -- prefix search, for the decoding constraint -------------------------------------

    @cached_property
    def _sorted_starts(self) -> tuple[list[str], list[int]]:
        """Word-start suffixes (their first ``_KEY_LEN`` characters), sorted, with their
        offsets: a prefix's occurrences are one contiguous run, found by bisection."""
        t = self.text
        order = sorted(self._starts, key=lambda s: t[s : s + _KEY_LEN])
        return [t[s : s + _KEY_LEN] for s in order], order

    def prepare(self) -> None:
        """Build the prefix index now (it is built on first use otherwise)."""
        _ = self._sorted_starts

    def occurrences(self, prefix: str) -> list[int]:
        """Offsets in ``text`` just past each occurrence of the folded ``prefix`` that
        starts at a word start (``prefix`` may end mid-word or with its separator)."""
        keys, offsets = self._sorted_starts
        head = prefix[:_KEY_LEN]
        lo = bisect_left(keys, head)
        hi = bisect_left(keys, head + "\U0010ffff", lo)  # never in folded text (a Cn)
        found = offsets[lo:hi]
        if len(prefix) > _KEY_LEN:
            found = [s for s in found if self.text.startswith(prefix, s)]
        return [s + len(prefix) for s in found]

    def occurs(self, prefix: str) -> bool:
        """Whether the folded ``prefix`` occurs at some word start."""
        if len(prefix) > _KEY_LEN:
            return bool(self.occurrences(prefix))
        keys, _ = self._sorted_starts
        at = bisect_left(keys, prefix)
        return at < len(keys) and keys[at].startswith(prefix)

    def word_rest(self, prefix: str) -> int:
        """The fewest folded characters that end the last word of ``prefix`` at one of its
        occurrences: 0 after a separator, a whole word for ``""``; a large number where
        ``prefix`` does not occur."""
        if prefix.endswith(" "):
            return 0
        got = self._rest.get(prefix)
        if got is None:
            t = self.text
            got = min((t.index(" ", e) - e for e in self.occurrences(prefix)), default=1 << 30)
            self._rest[prefix] = got
        return got

    def names_one_chunk(self, phrase: str) -> bool:
        """Whether the folded ``phrase`` (no trailing separator) is whole words at every
        word start it occurs at and resolves as an exact match to one chunk. Cached: the
        decoding constraint and the fixed text ask it of the same phrase."""
        got = self._one.get(phrase)
        if got is None:
            ends = self.occurrences(phrase)
            res = self.resolve(phrase) if ends and all(self.text[e] == " " for e in ends) else None
            got = (res is not None and res.accepted and res.quality is MatchQuality.EXACT
                   and len(res.ids) == 1)
            self._one[phrase] = got
        return got

    def continuations(self, prefix: str, length: int) -> set[str]:
        """The distinct next ``length`` characters after the occurrences of ``prefix``."""
        t = self.text
        return {t[e : e + length] for e in self.occurrences(prefix)}
