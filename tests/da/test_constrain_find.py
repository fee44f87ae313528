"""Tests for the find constraint: the fast candidate lookup against the per-token
reference, what it lets through resolves, and the real tokenizer."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.api.constrained import constrain
from declattn.da.constrain import FocusConstraint, FocusVocab, tag_part
from declattn.da.constrain_find import (
    FindConstraint,
    FindVocab,
    find_piece_ok,
    in_find_declaration,
)
from declattn.protocol.find import PhraseFinder
from declattn.protocol.grammar import MAX_FIND_TAG_LEN, MAX_FIND_WORDS, DeclineReason
from declattn.protocol.tags import TagReader

CHUNKS = [
    "The bakery on Mill Lane sells rye bread.",
    "The last train to Leeds leaves at 11:40 pm.",
    "Leeds\u2019s trains: the last one is late.",
]
FINDER = PhraseFinder(CHUNKS)
OPEN = '<focus find="'

FAKE = [
    '"', "'", '">', '" >', '"\n', ">", "=", '="', "='", " =", " ", "\t", "last", " last",
    " train", "train", "tra", "in", "ins", " to", " Leeds", "Leeds", ",", ", ", "s", "The",
    " the", "the", "x", "'s", "\u2019s", "\u2019", '.">', '">\nThe', "<", "\n", "", "\ufffd",
    "11", ":", "40", " pm", " Mill", " Lane", "Lane", " rye", " bread", '"bread', ' "', "=\"the",
    '="x">', "'>", "s'>", " late", " one", " is", "(", ")", '")', '"x', " 11:40",
]
FAKE += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789" if c not in FAKE]  # as real vocabs
VOCAB = FindVocab.from_texts(dict(enumerate(FAKE)))


def allowed_texts(pending: str, finder: PhraseFinder = FINDER) -> set[str]:
    ids = VOCAB.allowed(pending, finder)
    assert ids is not None
    return {FAKE[i] for i in ids}


def reference_texts(pending: str, finder: PhraseFinder = FINDER) -> set[str]:
    return {t for t in FAKE if find_piece_ok(pending, tag_part(t), finder)}


# -- pinned cases --------------------------------------------------------------------


def test_outside_a_find_tag_nothing_is_constrained() -> None:
    for pending in ("", "<", "<focus", "<focus fin", '<focus magic_chunks="', "text"):
        assert VOCAB.allowed(pending, FINDER) is None
        assert not in_find_declaration(pending)
    assert in_find_declaration("<focus find") and in_find_declaration(OPEN + "last")


def test_before_the_quote_only_the_equals_sign_spaces_and_a_quote() -> None:
    assert allowed_texts("<focus find") == {"=", '="', "='", " =", " ", "\t", '="the'}
    # '"' then ")" is a leading separator; "'s" opens with ' and "s" starts "sells"
    assert allowed_texts("<focus find=") == {'"', "'", " ", "\t", ' "', '"bread', '")', "'s"}


def test_the_phrase_may_only_grow_into_chunk_text() -> None:
    got = allowed_texts(OPEN)
    # any word start of any chunk, in any case, with or without its leading space
    assert {"last", " last", "The", " the", "Leeds", " Mill", "Lane", " pm", "tra", "11"} <= got
    assert not got & {"x", "in", "ins", '"', '">', ">"}  # no chunk word starts so; no close
    assert {" ", "(", ","} <= got  # leading separators change nothing
    assert allowed_texts(OPEN + "last") >= {" train", " ", '">'}  # "last" is a whole word
    assert not allowed_texts(OPEN + "last") & {"train", " to"}
    # mid-word: finish it (an apostrophe adds nothing); not "last trains": no chunk has it
    assert allowed_texts(OPEN + "last tra") == {"i", "in", "'", "\u2019"}
    assert " to" in allowed_texts(OPEN + "last train")
    assert " Leeds" not in allowed_texts(OPEN + "last train")


def test_the_closing_quote_is_writable_once_a_whole_word_matches() -> None:
    closers = {'"', '">', '" >', '.">', '">\nThe'}
    assert closers <= allowed_texts(OPEN + "last train")
    assert closers <= allowed_texts(OPEN + "last train to Leeds")
    assert not allowed_texts(OPEN + "last tra") & closers  # "tra" is no word
    assert not allowed_texts(OPEN + "  ") & closers  # no word yet
    assert '"\n' not in allowed_texts(OPEN + "last train")  # a newline breaks the tag
    assert '")' not in allowed_texts(OPEN + "last train")  # only spaces and ">" after it
    assert allowed_texts(OPEN + 'last train"') == {">", " ", "\t"}


def test_apostrophes_and_the_quote_that_opened_the_value() -> None:
    assert "\u2019s" in allowed_texts(OPEN + "Leeds")  # Leeds’s folds to leedss
    assert "'s" in allowed_texts(OPEN + "Leeds")  # in "..." an apostrophe is a letter gap
    single = allowed_texts("<focus find='Leeds")
    assert "'s" not in single  # in '...' the apostrophe closes the value: "leeds" then "s"
    assert {"'", "'>", '"'} <= single  # in '...' a double quote is punctuation
    assert '">' not in single  # ... and a ">" inside the value would end the tag
    assert "s'>" in single  # "leedss" is a whole word (Leeds’s) and closes


def test_punctuation_inside_the_phrase_is_a_separator() -> None:
    assert {",", ", ", " "} <= allowed_texts(OPEN + "rye")
    assert " bread" in allowed_texts(OPEN + "rye,")
    assert " 11:40" in allowed_texts(OPEN + "at")


def test_ambiguity_does_not_block_the_closing() -> None:
    finder = PhraseFinder([f"day {i} the harbour" for i in range(1, 6)])
    assert '">' in allowed_texts(OPEN + "the", finder)
    reader = TagReader(5, finder=finder)
    (d,) = reader.feed(OPEN + 'the">')
    assert d.declined == DeclineReason.AMBIGUOUS  # the reader's decline, not a trap


def test_the_tag_must_fit_in_max_find_tag_len() -> None:
    pad = OPEN + " " * (MAX_FIND_TAG_LEN - len(OPEN) - len("last") - 2)
    got = allowed_texts(pad)
    assert "last" in got and " last" not in got  # " last" leaves no room for '">'
    assert '">' in allowed_texts(pad + "last") and '" >' not in allowed_texts(pad + "last")


def test_word_limit() -> None:
    words = " ".join(f"w{i}" for i in range(MAX_FIND_WORDS + 2))
    finder = PhraseFinder([words])
    vocab = FindVocab.from_texts({0: " w12", 1: " w11", 2: '">', 3: "w0"})
    eleven = OPEN + " ".join(f"w{i}" for i in range(MAX_FIND_WORDS - 1))
    assert set(vocab.allowed(eleven, finder) or []) == {1, 2}  # the 12th word, or close
    # a 13th word occurs in the chunk but is over the limit: only the closing is left
    assert set(vocab.allowed(eleven + " w11", finder) or []) == {2}


def test_a_broken_tag_leaves_no_candidate() -> None:
    assert allowed_texts("<focus findx") == set()
    assert allowed_texts(OPEN + "bus") == set()  # written unconstrained: no way on
    assert allowed_texts('<focus find="a" x') == set()


# -- the fast lookup equals the per-token reference ------------------------------------


@st.composite
def pendings(draw: st.DrawFn) -> str:
    """Pending texts inside a find tag: chunk text prefixes, with junk and both quotes."""
    quote = draw(st.sampled_from(['"', "'"]))
    head = draw(st.sampled_from(["<focus find", "<focus find ", "<focus find=", "<focus find ="]))
    if draw(st.integers(0, 4)) == 0:
        return head
    text = draw(st.sampled_from(CHUNKS))
    start = draw(st.integers(0, len(text)))
    value = text[start : start + draw(st.integers(0, 30))]
    if draw(st.booleans()):
        value = draw(st.sampled_from(["", " ", "x", ",", "\u201c"])) + value
    tail = draw(st.sampled_from(["", "", "", quote, quote + " "]))
    return head.rstrip("=") + "=" + quote + value.replace(quote, "").replace(">", "") + tail


@settings(max_examples=400, deadline=None)
@given(pendings())
def test_fast_lookup_equals_the_reference(pending: str) -> None:
    assert allowed_texts(pending) == reference_texts(pending), pending


@settings(max_examples=100, deadline=None)
@given(pendings())
def test_the_cache_changes_nothing(pending: str) -> None:
    c = FindConstraint(VOCAB, FINDER)
    c.prepare()
    assert c.allowed(pending) == VOCAB.allowed(pending, FINDER)
    assert c.allowed(pending) == VOCAB.allowed(pending, FINDER)  # from the cache
    index = c.allowed_ids(pending)  # what a row is masked with: an array on most steps
    plain = c.allowed(pending)
    assert (index is None) == (plain is None)
    if index is not None and plain is not None:
        got = index.tolist() if isinstance(index, np.ndarray) else index
        assert sorted(got) == sorted(plain)


def test_what_is_allowed_resolves_as_an_exact_match() -> None:
    """Random walks over allowed tokens: every finished tag is an accepted exact focus,
    and the walk is never stuck once the phrase holds a whole word."""
    rng = random.Random(16)
    parts = dict(enumerate(FAKE))
    finished = 0
    for _ in range(400):
        pending = "<focus find"
        while True:
            ids = VOCAB.allowed(pending, FINDER)
            assert ids, pending  # never stuck
            piece = parts[rng.choice(ids)]
            if ">" in piece:
                pending += piece[: piece.index(">") + 1]
                break
            pending += piece
        reader = TagReader(len(CHUNKS), finder=FINDER)
        (d,) = reader.feed(pending)
        assert d.accepted and d.match == "exact", d
        assert d.end == len(pending)
        finished += 1
    assert finished == 400


# -- masking ---------------------------------------------------------------------------


def test_mask_and_stats() -> None:
    c = FindConstraint(VOCAB, FINDER)
    logits = torch.zeros(len(FAKE) + 3)
    x, last = FAKE.index("x"), FAKE.index("last")
    logits[x] = 50.0
    out = constrain([c], logits, OPEN, index=4)
    assert out[x] == float("-inf") and out[last] == 0.0 and int(out.argmax()) != x
    assert torch.isneginf(out[len(FAKE) :]).all()
    assert c.stats.steps == 1 and c.stats.changed == [4]
    assert constrain([c], logits, "plain", index=5) is logits and c.stats.steps == 1
    stuck = constrain([c], logits, OPEN + "bus", index=6)  # no candidate: the row is left alone
    assert stuck is logits and c.stats.unmasked == 1


def test_the_two_constraints_leave_each_other_alone() -> None:
    ids = FocusConstraint(FocusVocab.from_texts(dict(enumerate(FAKE))), n_chunks=3)
    find = FindConstraint(VOCAB, FINDER)
    logits = torch.randn(len(FAKE))
    assert constrain([ids], logits, OPEN + "last", 1) is logits
    assert constrain([find], logits, '<focus magic_chunks="', 1) is logits


# -- the real tokenizer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_find_vocab(smol_tokenizer) -> FindVocab:
    return FindVocab.from_tokenizer(smol_tokenizer)


def test_real_tokens_of_a_valid_phrase_are_all_allowed(smol_tokenizer, smol_find_vocab) -> None:
    """The natural tokenisation of a phrase the chunks contain is never blocked, and one
    they do not contain is, at the first token that leaves the chunk text."""
    from declattn.engine.detok import Detokenizer

    constraint = FindConstraint(smol_find_vocab, FINDER)
    constraint.prepare()
    tok = smol_tokenizer

    def walk(tag: str) -> list[bool]:
        ids = tok.encode(tag, add_special_tokens=False)
        detok, pending, verdicts = Detokenizer(tok), "", []
        for i in ids:
            allowed = constraint.allowed(pending) if pending.startswith("<focus find") else None
            if allowed is not None:
                verdicts.append(i in allowed)
            pending += detok.add(i)
        return verdicts

    good = walk('<focus find="last train to Leeds">')
    assert good and all(good)
    assert all(walk('<focus find="Mill Lane">'))
    bad = walk('<focus find="last train to York">')
    assert True in bad and False in bad
    assert bad == sorted(bad, reverse=True)  # allowed up to "York", refused from there


def test_real_vocab_agrees_with_the_reference(smol_find_vocab) -> None:
    for pending in (OPEN, OPEN + "last", OPEN + "last tr", OPEN + "Leeds", "<focus find",
                    OPEN + "rye bread", OPEN + 'rye bread"'):
        fast = set(smol_find_vocab.allowed(pending, FINDER) or [])
        slow = {i for i, p in smol_find_vocab.parts.items() if find_piece_ok(pending, p, FINDER)}
        assert fast == slow, pending
