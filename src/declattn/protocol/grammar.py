"""The limits of the tag grammar, and why a declaration is refused: shared by the tag
reader (``tags``) and the phrase finder (``find``), which both judge declarations."""

from __future__ import annotations

from enum import StrEnum

MAX_TAG_LEN = 96
MAX_FIND_TAG_LEN = 160
"""A find tag's limit: ``<focus find="">`` is 15 characters, which leaves room for
``MAX_FIND_WORDS`` words of up to about 11 characters each."""
MAX_FOCUS_IDS = 3
MAX_FIND_WORDS = 12
"""Longest find phrase, in folded words: a find phrase names a fact, it does not quote it."""


class DeclineReason(StrEnum):
    """Why a declaration was refused; the request stays in global either way."""

    UNKNOWN_ID = "unknown chunk id"
    TOO_MANY_IDS = "more than 3 chunk ids"
    BAD_SYNTAX = "bad syntax"
    NOT_IN_GLOBAL = "focus while not in global"
    FIND_AND_IDS = "find and magic_chunks together"
    NO_CHUNK_TEXTS = "find, but the reader has no chunk texts"
    EMPTY_PHRASE = "find phrase has no words"
    PHRASE_TOO_LONG = f"find phrase over {MAX_FIND_WORDS} words"
    NO_MATCH = "find phrase in no chunk"
    AMBIGUOUS = f"find phrase in more than {MAX_FOCUS_IDS} chunks"
