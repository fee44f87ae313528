"""Test helper: a find phrase that names one chunk alone, looked up as the reader will."""

from __future__ import annotations

from collections.abc import Sequence

from declattn.protocol.find import PhraseFinder


def naming_phrase(chunk_texts: Sequence[str], chunk_id: int) -> str:
    """Three consecutive words of chunk ``chunk_id`` (letters and digits only) whose find
    focus resolves to that chunk and no other."""
    finder = PhraseFinder(chunk_texts)
    words = chunk_texts[chunk_id - 1].split()
    for i in range(len(words) - 2):
        window = words[i : i + 3]
        phrase = " ".join(window)
        if all(w.isascii() and w.isalnum() for w in window) and \
                finder.resolve(phrase).ids == (chunk_id,):
            return phrase
    raise AssertionError(f"no phrase names chunk {chunk_id} alone")
