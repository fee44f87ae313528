"""Tests for find-phrase resolution: folding, exact and window matches, ranking, declines."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.protocol.find import (
    WINDOW_SLACK,
    MatchQuality,
    PhraseFinder,
    fold,
    normalize,
    phrase_words,
)
from declattn.protocol.grammar import MAX_FIND_WORDS, MAX_FOCUS_IDS, DeclineReason

DEMO = [
    "The bakery on Mill Lane sells rye bread.",
    "Our choir meets on Tuesdays.",
    "The last train to Leeds leaves at 11:40 pm.",
    "Parking is free after six.",
]

# -- folding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, folded",
    [
        ("Last Train", "last train"),  # case
        ("LAST\t train\n\nto  Leeds", "last train to leeds"),  # whitespace of any kind
        ("last, train; to: Leeds!", "last train to leeds"),  # punctuation separates
        ('"last train"', "last train"),  # ASCII double quotes
        ("\u201clast train\u201d \u201elast\u201f", "last train last"),  # curly and low quotes
        ("\u00ablast train\u00bb \u2039x\u203a", "last train x"),  # guillemets
        ("O'Brien O\u2019Brien OBrien O\u02bcBrien", "obrien obrien obrien obrien"),
        ("\u2018train\u2019 `train\u00b4", "train train"),  # apostrophe-like quotes vanish
        ("11:40 pm", "11 40 pm"),  # digits are words, the colon separates
        ("well-known \u2014 e-mail", "well known e mail"),  # hyphens and dashes separate
        ("Stra\u00dfe", "strasse"),  # full case folding
        ("\ufb01ne \uff21\uff22", "fine ab"),  # compatibility forms (ligature, full width)
        ("Lee\u00adds Lee\u200bds", "leeds leeds"),  # soft hyphen, zero-width space dropped
        ("snake_case", "snake case"),
        ("\u5317\u4eac\u5e02", "\u5317 \u4eac \u5e02"),  # each ideograph is a word
        ("caf\u00e9", "cafe\u0301"),  # accents are kept (decomposed), not stripped
        ("  ,.;  ", ""),
        ("", ""),
    ],
)
def test_normalisation_examples(text: str, folded: str) -> None:
    assert normalize(text) == folded


def test_accents_are_not_folded_away_but_forms_agree() -> None:
    assert normalize("caf\u00e9") == normalize("cafe\u0301")  # composed == decomposed
    assert normalize("caf\u00e9") != normalize("cafe")


def test_fold_keeps_one_separator_at_the_ends() -> None:
    assert fold(" , last  train. ") == " last train "
    assert phrase_words(" , last  train. ") == ("last", "train")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_fold_is_compositional(a: str, b: str) -> None:
    """Folding pieces then joining equals folding the whole: what lets the constraint
    fold each token once per tokenizer."""
    assert re.sub(" {2,}", " ", fold(a) + fold(b)) == fold(a + b)


# -- resolution: pinned examples ---------------------------------------------------------


def test_exact_phrase() -> None:
    res = PhraseFinder(DEMO).resolve("last train to Leeds")
    assert (res.ids, res.quality, res.declined) == ((3,), MatchQuality.EXACT, None)
    assert res.accepted and res.words == ("last", "train", "to", "leeds")


@pytest.mark.parametrize(
    "phrase", ["LAST TRAIN to leeds", "\u201clast train\u201d", " last,  train ", "train to"]
)
def test_exact_after_normalisation(phrase: str) -> None:
    res = PhraseFinder(DEMO).resolve(phrase)
    assert (res.ids, res.quality) == ((3,), MatchQuality.EXACT)


def test_whole_words_only() -> None:
    f = PhraseFinder(["the trains run late", "a training day"])
    assert f.resolve("train").declined == DeclineReason.NO_MATCH
    assert f.resolve("trains").ids == (1,)


def test_window_fallback_any_order_within_the_slack() -> None:
    f = PhraseFinder(DEMO)
    res = f.resolve("Leeds train")  # both words, other order, 2 apart
    assert (res.ids, res.quality) == ((3,), MatchQuality.WINDOW)
    filler = " ".join(["word"] * (WINDOW_SLACK))
    near = PhraseFinder([f"alpha {filler} beta", "nothing"])
    assert near.resolve("beta alpha").quality == MatchQuality.WINDOW  # span = 2 + slack
    far = PhraseFinder([f"alpha {filler} x beta", "nothing"])
    assert far.resolve("beta alpha").declined == DeclineReason.NO_MATCH  # one word too far


def test_window_needs_every_word() -> None:
    assert PhraseFinder(DEMO).resolve("Leeds bus").declined == DeclineReason.NO_MATCH


def test_exact_beats_window() -> None:
    f = PhraseFinder(["train to the coast, Leeds later", "the last train to Leeds"])
    res = f.resolve("train to Leeds")
    assert (res.ids, res.quality) == ((2,), MatchQuality.EXACT)  # chunk 1 only has a window


def test_ranking_by_count_then_span_then_id() -> None:
    texts = ["red fox", "red fox, red fox", "the fox was red", "red fox"]
    res = PhraseFinder(texts).resolve("red fox")
    assert (res.ids, res.quality) == ((2, 1, 4), MatchQuality.EXACT)  # 2 holds two; 3 ignored
    pad = " ".join(["pad"] * (WINDOW_SLACK + 2))  # keeps windows inside their chunks
    texts = [f"fox and a very red hat {pad}", f"fox red {pad}", f"red big fox {pad}"]
    win = PhraseFinder(texts).resolve("red fox")
    assert (win.ids, win.quality) == ((2, 3, 1), MatchQuality.WINDOW)  # spans 2, 3, 5 words
    tie = PhraseFinder([f"fox red {pad}", f"red fox {pad}"[4:], f"fox red {pad}"])
    assert tie.resolve("fox red").ids == (1, 3)  # same count and span: by id


def test_a_phrase_across_a_chunk_boundary_names_both_chunks() -> None:
    res = PhraseFinder(["the last train", " to Leeds leaves late", "other"]).resolve(
        "train to Leeds"
    )
    assert (set(res.ids), res.quality) == ({1, 2}, MatchQuality.EXACT)


def test_repeated_words_in_the_phrase() -> None:
    f = PhraseFinder(["to be or not to be", "to be"])
    assert f.resolve("to be or not to be").ids == (1,)
    pad = " ".join(["pad"] * (WINDOW_SLACK + 3))
    g = PhraseFinder([f"to be or not to be {pad}", f"{pad} to be {pad}"])
    res = g.resolve("be to be")
    assert (res.ids, res.quality) == ((1,), MatchQuality.WINDOW)  # chunk 2 has one "be"


# -- declines --------------------------------------------------------------------------


@pytest.mark.parametrize("phrase", ["", "   ", '",.;', "\u201c\u201d", "\u00ad"])
def test_decline_empty_phrase(phrase: str) -> None:
    res = PhraseFinder(DEMO).resolve(phrase)
    assert res.declined == DeclineReason.EMPTY_PHRASE == "find phrase has no words"
    assert res.ids == () and res.quality is None and not res.accepted


def test_decline_phrase_too_long() -> None:
    words = [f"w{i}" for i in range(MAX_FIND_WORDS + 1)]
    f = PhraseFinder([" ".join(words)])
    assert f.resolve(" ".join(words[:MAX_FIND_WORDS])).ids == (1,)
    res = f.resolve(" ".join(words))
    assert res.declined == DeclineReason.PHRASE_TOO_LONG == "find phrase over 12 words"
    assert MAX_FIND_WORDS == 12


def test_decline_no_match() -> None:
    res = PhraseFinder(DEMO).resolve("first bus to York")
    assert res.declined == DeclineReason.NO_MATCH == "find phrase in no chunk"
    assert res.matched == () and res.quality is None


def test_decline_ambiguous() -> None:
    texts = [f"chunk {i} mentions the harbour" for i in range(1, 6)]
    res = PhraseFinder(texts).resolve("the harbour")
    assert res.declined == DeclineReason.AMBIGUOUS == "find phrase in more than 3 chunks"
    assert res.ids == () and res.matched == (1, 2, 3, 4, 5)
    assert res.quality == MatchQuality.EXACT
    assert PhraseFinder(texts[:MAX_FOCUS_IDS]).resolve("the harbour").ids == (1, 2, 3)


def test_no_chunks() -> None:
    f = PhraseFinder([])
    assert f.n_chunks == 0 and f.resolve("x").declined == DeclineReason.NO_MATCH


def test_bad_chunk_text() -> None:
    with pytest.raises(TypeError):
        PhraseFinder(["ok", b"bytes"])  # type: ignore[list-item]


# -- resolution against a brute-force reference ----------------------------------------


def reference(texts: list[str], phrase: str) -> tuple[tuple[int, ...], str | None, object]:
    """Every window of the word sequence checked directly: (ids, quality, declined)."""
    words, owner = [], []
    for cid, t in enumerate(texts, 1):
        ws = normalize(t).split()
        words += ws
        owner += [cid] * len(ws)
    want = normalize(phrase).split()
    if not want:
        return (), None, DeclineReason.EMPTY_PHRASE
    if len(want) > MAX_FIND_WORDS:
        return (), None, DeclineReason.PHRASE_TOO_LONG
    n = len(want)
    exact = [(i, i + n - 1) for i in range(len(words) - n + 1) if words[i : i + n] == want]
    quality = "exact"
    hits = exact
    if not hits:
        quality = "window"
        limit = n + WINDOW_SLACK
        hits = []
        for last in range(len(words)):
            # the shortest window ending at `last` that holds every word, as often
            for first in range(last, max(-1, last - limit), -1):
                window = words[first : last + 1]
                if all(window.count(w) >= want.count(w) for w in want):  # first is shortest
                    if words[last] in want:
                        hits.append((first, last))
                    break
    if not hits:
        return (), None, DeclineReason.NO_MATCH
    count: dict[int, int] = {}
    span: dict[int, int] = {}
    for a, b in hits:
        for c in range(owner[a], owner[b] + 1):
            count[c] = count.get(c, 0) + 1
            span[c] = min(span.get(c, b - a + 1), b - a + 1)
    ranked = tuple(sorted(count, key=lambda c: (-count[c], span[c], c)))
    if len(ranked) > MAX_FOCUS_IDS:
        return (), quality, DeclineReason.AMBIGUOUS
    return ranked, quality, None


_VOCAB = ["red", "fox", "the", "Leeds", "train", "to", "a", "x", "red"]
texts_st = st.lists(
    st.lists(st.sampled_from(_VOCAB + [",", ". ", "\n"]), max_size=14).map(" ".join),
    min_size=1,
    max_size=6,
)
phrase_st = st.lists(st.sampled_from(_VOCAB), min_size=0, max_size=4).map(" ".join)


@settings(max_examples=400, deadline=None)
@given(texts_st, phrase_st)
def test_resolution_matches_the_brute_force_reference(texts: list[str], phrase: str) -> None:
    res = PhraseFinder(texts).resolve(phrase)
    ids, quality, declined = reference(texts, phrase)
    assert (res.ids, res.quality, res.declined) == (ids, quality, declined)
    again = PhraseFinder(list(texts)).resolve(phrase)  # deterministic, from the texts alone
    assert again == res


# -- prefix search (what the constraint reads) -----------------------------------------


def test_prefix_search() -> None:
    f = PhraseFinder(DEMO)
    assert f.text.startswith("the bakery on mill lane sells rye bread our choir")
    assert f.occurs("last tr") and f.occurs("last train ") and not f.occurs("ast train")
    assert not f.occurs("last trains")
    ends = f.occurrences("the ")
    assert len(ends) == 2 and all(f.text[e - 4 : e] == "the " for e in ends)
    assert f.continuations("last train ", 4) == {"to l"}
    assert f.occurs("") and len(f.occurrences("")) == f.n_words


def test_long_prefixes_are_verified_beyond_the_sorted_key() -> None:
    base = " ".join(f"word{i}" for i in range(30))
    f = PhraseFinder([base + " alpha", base + " beta"])
    p = normalize(base)
    assert len(p) > 64
    assert len(f.occurrences(p + " ")) == 2
    assert f.continuations(p + " ", 4) == {"alph", "beta"}
    assert f.occurs(p + " b") and not f.occurs(p + " c")


def test_names_one_chunk_needs_whole_words_everywhere_and_one_exact_chunk() -> None:
    f = PhraseFinder(["the bakery sells rye bread", "the last train to leeds", "day 10 and day 1"])
    assert f.names_one_chunk("last train") and f.names_one_chunk("leeds")
    assert not f.names_one_chunk("the")  # chunks 1 and 2
    assert not f.names_one_chunk("sell")  # "sells": not a whole word where it occurs
    assert not f.names_one_chunk("day 1")  # "day 10" goes on inside the word
    assert not f.names_one_chunk("bread the")  # across the boundary: chunks 1 and 2
    assert not f.names_one_chunk("ferry")  # nowhere
