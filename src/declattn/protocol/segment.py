"""Cut a context into magic chunks on natural boundaries.

A chunk is what a model names when it declares focus, so chunks should be about the
same size (the target), never too big for the scope to pay off (the cap), and cut where
a reader would cut: between paragraphs first, mid-word only when the text leaves no
other choice. The segmenter is the first step of every request, so it must stay cheap on
long contexts: text is tokenised in small pieces, each piece about once, and no probe
ever tokenises more than a few chunks' worth of text.

Everything works in character offsets of the context. Decoding token slices back to
text would break multibyte characters and lose bytes; offsets make the result lossless
by construction: joining the chunk texts gives the context back exactly.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Chunk", "SegmentError", "segment", "token_counter"]

# Line breaks as str.splitlines sees them, "\r\n" first so it is never split in two.
_LB = r"(?:\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029])"
# Horizontal whitespace: whitespace that is not a line break.
_HWS = r"[^\S\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]"

# Separators in order of preference. A match ends a piece: separators stay attached to
# the text before them, so a chunk never starts with the blank line that ended the last.
_LEVELS: tuple[re.Pattern[str], ...] = (
    re.compile(rf"{_LB}(?:{_HWS}*{_LB})+|\u2029"),  # blank lines
    re.compile(_LB),  # line breaks
    re.compile(  # sentence ends (Latin needs a space after; CJK full stops do not)
        r"[.!?\u2026\u203d]+[\"'\u201d\u2019\u00bb)\]}]*\s+"
        r"|[\u3002\uff01\uff1f\uff61]+[\u300d\u300f\u201d\u2019\uff09)\]]*\s*"
    ),
    re.compile(r"[;:,\uff1b\uff1a\uff0c\u3001]+\s*"),  # clause marks
    re.compile(r"\s+"),  # any whitespace
)
_HARD = len(_LEVELS)  # the level below the last separator: cut between characters

# How much text the chars-per-token estimate reads, in a few windows of the context.
_SAMPLE_WINDOW = 2048
_SAMPLE_COUNT = 3
# Small units are counted in groups of about target / _GROUP_DIVISOR tokens: fine enough
# that greedy merging lands close to the target, coarse enough to keep calls few.
_GROUP_DIVISOR = 8
# A unit estimated at more than this many caps is split without counting it first.
_UNCOUNTED_CAPS = 4


class SegmentError(ValueError):
    """The context cannot be cut into chunks (empty, blank, or a character over the cap)."""


@dataclass(frozen=True)
class Chunk:
    """One magic chunk: ``context[start:end] == text``, counting ``tokens`` on its own.

    ``tokens`` is the count of the chunk text alone; inside a rendered prompt the count can
    differ by a token at the edges, which is why the layout is derived from the rendered
    prompt and never from these numbers.
    """

    id: int
    start: int
    end: int
    text: str
    tokens: int

    def __post_init__(self) -> None:
        if self.id < 1:
            raise ValueError(f"chunk ids start at 1, got {self.id}")
        if not 0 <= self.start < self.end or self.end - self.start != len(self.text):
            raise ValueError(f"chunk {self.id}: offsets [{self.start}, {self.end}) do not "
                             f"match its text of {len(self.text)} characters")


def segment(
    context: str,
    count_tokens: Callable[[str], int],
    target: int = 2048,
    cap: int = 2560,
) -> list[Chunk]:
    """Cut ``context`` into chunks of about ``target`` tokens, none over ``cap``.

    Units over the cap are split at the most natural separator they contain (blank lines,
    line breaks, sentence ends, ``;:,``, whitespace, then between characters); the pieces
    are merged greedily with their neighbours up to the target. Piece counts do not add up
    exactly under BPE, so each merged chunk is counted for real and split again if it
    exceeds the cap. ``count_tokens`` is any text -> token count callable, normally the
    served tokenizer without special tokens.
    """
    if isinstance(target, bool) or not isinstance(target, int) or target <= 0:
        raise ValueError(f"target must be a positive number of tokens, got {target!r}")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < target:
        raise ValueError(f"cap must be an integer at least the target ({target}), got {cap!r}")
    if not context:
        raise SegmentError("the context is empty: there is nothing to cut into chunks")
    if context.isspace():
        raise SegmentError(
            f"the context is whitespace only ({len(context)} characters): no chunk would "
            "hold any content"
        )
    return _Segmenter(context, count_tokens, target, cap).run()


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """A ``count_tokens`` for a Hugging Face tokenizer or a raw ``tokenizers.Tokenizer``.

    Special tokens are left out: a chunk is counted as the text it adds to a prompt.
    Every path that cuts or sizes text (segmenter, task generators, benchmarks) counts
    with this one function, so a chunk's size means the same everywhere.
    """

    def count(text: str) -> int:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        return len(encoded.ids if hasattr(encoded, "ids") else encoded)

    return count


class _Segmenter:
    """State of one ``segment`` call; pieces are ``(start, end, tokens)`` triples."""

    def __init__(
        self, text: str, count_tokens: Callable[[str], int], target: int, cap: int
    ) -> None:
        self.text = text
        self._count_fn = count_tokens
        self.target = target
        self.cap = cap
        cpt = self._chars_per_token()
        # Longest run of pieces counted as one group, and longest unit worth counting.
        self.group_chars = max(1, int(cpt * target / _GROUP_DIVISOR))
        self.uncounted_chars = max(64, int(cpt * cap * _UNCOUNTED_CAPS))
        self.cpt = cpt

    def count(self, start: int, end: int) -> int:
        return int(self._count_fn(self.text[start:end]))

    def _chars_per_token(self) -> float:
        """Estimate characters per token from a few windows, taking the densest.

        The densest window wins because the estimate sizes probes: guessing too few
        characters per token costs an extra probe, guessing too many costs a huge one.
        """
        n = len(self.text)
        if n <= _SAMPLE_WINDOW * _SAMPLE_COUNT:
            starts = [0]
            width = n
        else:
            step = (n - _SAMPLE_WINDOW) // (_SAMPLE_COUNT - 1)
            starts = [i * step for i in range(_SAMPLE_COUNT)]
            width = _SAMPLE_WINDOW
        best = float("inf")
        for s in starts:
            tokens = self.count(s, s + width)
            best = min(best, width / max(1, tokens))
        return min(max(best, 1 / 16), 64.0)

    def run(self) -> list[Chunk]:
        n = len(self.text)
        pieces: list[tuple[int, int, int]] = []
        if n <= self.uncounted_chars and (tokens := self.count(0, n)) <= self.cap:
            pieces.append((0, n, tokens))
        else:
            self._split(0, n, 0, pieces)
        chunks: list[Chunk] = []
        for group in self._merge(pieces):
            for start, end, tokens in self._verify(group):
                chunks.append(Chunk(len(chunks) + 1, start, end, self.text[start:end], tokens))
        return chunks

    # -- splitting -------------------------------------------------------------------

    def _split(self, start: int, end: int, level: int, out: list[tuple[int, int, int]]) -> None:
        """Split ``[start, end)``, known or presumed over the cap, at ``level`` or below."""
        if level >= _HARD:
            self._hard_split(start, end, out)
            return
        cuts = [
            m.end()
            for m in _LEVELS[level].finditer(self.text, start, end)
            if m.end() < end
        ]
        if not cuts:
            self._split(start, end, level + 1, out)
            return
        bounds = [start, *cuts, end]
        # Never let one group be the whole unit again: it is already known too big.
        limit = min(self.group_chars, max(1, (end - start) // 2))
        i = 0
        while i < len(bounds) - 1:
            j = i + 1
            while j < len(bounds) - 1 and bounds[j + 1] - bounds[i] <= limit:
                j += 1
            a, b = bounds[i], bounds[j]
            if j - i == 1:
                self._unit(a, b, level, out)
            elif (tokens := self.count(a, b)) <= self.cap:
                out.append((a, b, tokens))
            else:  # the estimate was off: count the pieces one by one
                for k in range(i, j):
                    self._unit(bounds[k], bounds[k + 1], level, out)
            i = j

    def _unit(self, start: int, end: int, level: int, out: list[tuple[int, int, int]]) -> None:
        """Keep one unit whole if it fits the cap, else split it one level further down."""
        if end - start <= self.uncounted_chars and (tokens := self.count(start, end)) <= self.cap:
            out.append((start, end, tokens))
        else:
            self._split(start, end, level + 1, out)

    def _hard_split(self, start: int, end: int, out: list[tuple[int, int, int]]) -> None:
        """Cut text with no separators left into pieces of at most ``target`` tokens."""
        p = start
        while p < end:
            if end - p <= self.uncounted_chars and (tokens := self.count(p, end)) <= self.cap:
                out.append((p, end, tokens))
                return
            q, tokens = self._cut(p, end)
            out.append((p, q, tokens))
            p = q

    def _cut(self, p: int, end: int) -> tuple[int, int]:
        """Find ``q`` in ``(p, end]`` with ``count(p, q) <= target``, ``q`` near the largest.

        A search over the end offset: interpolation from the counts seen so far, with every
        other step a plain bisection so the bracket always halves. Each probe reads at most
        about one target's worth of text plus the error of the estimate.
        """
        limit = self.target
        tolerance = limit // 100
        lo, lo_n = p, 0  # count(p, lo) <= limit
        hi, hi_n = end + 1, -1  # count(p, hi) > limit; hi_n < 0 while no such hi is known
        guess = p + max(1, int(limit * self.cpt))
        for step in range(128):
            guess = min(max(guess, lo + 1), hi - 1, end)
            n = self.count(p, guess)
            if n <= limit:
                lo, lo_n = guess, n
                if guess == end or n >= limit - tolerance:
                    break
            else:
                hi, hi_n = guess, n
            if hi - lo <= 1:
                break
            if hi_n < 0:  # no upper bound yet: extrapolate past the limit
                rate = (lo - p) / max(1, lo_n)
                guess = p + int(limit * rate * 1.05) + 1
                if lo_n == 0:
                    guess = p + 2 * (lo - p)
            elif step % 2 or hi_n <= lo_n:
                guess = (lo + hi) // 2
            else:
                guess = lo + int((hi - lo) * (limit - lo_n) / (hi_n - lo_n))
        if lo == p:  # even one character counts more than the target
            n = self.count(p, p + 1)
            if n > self.cap:
                raise SegmentError(
                    f"the character {self.text[p]!r} at offset {p} alone counts {n} tokens, "
                    f"over the cap of {self.cap}"
                )
            return p + 1, n
        if lo < end:
            q = lo
            while q > p + 1 and lo - q < 32 and _inside_grapheme(self.text, q):
                q -= 1
            if q != lo and not _inside_grapheme(self.text, q):
                n = self.count(p, q)
                if n <= self.cap:
                    return q, n
        return lo, lo_n

    # -- merging ---------------------------------------------------------------------

    def _merge(self, pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """Group consecutive pieces greedily while their summed count stays within target."""
        groups: list[list[tuple[int, int, int]]] = []
        current: list[tuple[int, int, int]] = []
        total = 0
        for piece in pieces:
            if current and total + piece[2] > self.target:
                groups.append(current)
                current, total = [], 0
            current.append(piece)
            total += piece[2]
        if current:
            groups.append(current)
        return groups

    def _verify(self, group: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Count a merged group for real; split it at its token midpoint if over the cap.

        A single piece was counted on its own already and fits the cap, so this ends.
        """
        if len(group) == 1:
            return group
        start, end = group[0][0], group[-1][1]
        tokens = self.count(start, end)
        if tokens <= self.cap:
            return [(start, end, tokens)]
        half = sum(p[2] for p in group) / 2
        acc = 0
        k = 1
        for k in range(1, len(group)):
            acc += group[k - 1][2]
            if acc >= half:
                break
        return self._verify(group[:k]) + self._verify(group[k:])


def _inside_grapheme(text: str, i: int) -> bool:
    """Whether a cut before ``text[i]`` would split what a reader sees as one character.

    Only the common cases: CR LF, combining marks, zero-width joiners, emoji modifiers and
    tag characters. A hard cut is rare and still lossless; this only keeps it tidy.
    """
    before, after = text[i - 1], text[i]
    if before == "\r" and after == "\n":
        return True
    if before == "\u200d" or after == "\u200d":
        return True
    if "\U0001f3fb" <= after <= "\U0001f3ff" or "\U000e0020" <= after <= "\U000e007f":
        return True
    return unicodedata.category(after) in ("Mn", "Mc", "Me")
