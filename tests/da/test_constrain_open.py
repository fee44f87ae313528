"""The reply opens with a tag: only tokens that begin an opening tag may come first,
and the constraint lets go once a token is written."""

from __future__ import annotations

import numpy as np
import pytest

from declattn.da.constrain_open import OpeningConstraint, OpeningVocab
from declattn.da.state import HEADS, DAState
from declattn.protocol.layout import Layout, Span

TEXTS = {1: "<", 2: "<f", 3: "<focus", 4: "Hello", 5: "<br", 6: "<answer>", 7: " <",
         8: "<global", 9: "</", 10: "<loc", 11: "<focus find", 12: "<answer>Yes"}


def test_ids_are_the_tokens_that_begin_an_opening_tag():
    vocab = OpeningVocab.from_texts(TEXTS)
    assert set(vocab.texts) == {1, 2, 3, 5, 6, 8, 9, 10, 11, 12}  # text starts with "<"
    assert vocab.ids_for(HEADS["find"]) == (1, 2, 3, 6, 8, 10, 11)
    # the id form's head is "<focus magic_chunks=": "<focus find" cannot begin it
    assert vocab.ids_for(HEADS["ids"]) == (1, 2, 3, 6, 8, 10)


def test_the_constraint_holds_the_first_token_only():
    layout = Layout(prompt_len=64, sink=Span(0, 4), chunks=(Span(4, 40),), question=Span(40, 64))
    vocab = OpeningVocab.from_texts(TEXTS)
    ids = vocab.ids_for(HEADS["find"])
    state = DAState(layout, ["some chunk text"], focus_form="find", opening_vocab=vocab)
    first = [c.allowed_ids("") for c in state.constraints]
    assert any(a is not None and np.array_equal(a, ids) for a in first)
    state.feed(1, "<")
    assert all(c.allowed_ids(state.reader.pending) is None for c in state.constraints
               if isinstance(c, OpeningConstraint))


def test_a_tokenizer_with_no_tag_opening_is_refused():
    with pytest.raises(ValueError, match="no token of this tokenizer can begin a tag"):
        OpeningConstraint(())
