"""Tags the economical protocol fixes. The reply opens with a tag: only tokens that begin
an opening tag may come first, and the constraint lets go once a token is written. The
answer follows a find focus at once: only the rest of ``<answer>`` may come next."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from declattn.da.constrain_open import (
    AnswerNextConstraint,
    OpeningConstraint,
    OpeningVocab,
    opens_alone,
)
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


@pytest.mark.parametrize("alone", [True, False])
def test_a_reply_that_opens_with_a_tag_has_its_lt_sign_fixed_where_it_is_a_token(alone):
    vocab = dataclasses.replace(OpeningVocab.from_texts(TEXTS), opens_alone=alone)
    state = DAState(LAYOUT, ["some chunk text"], focus_form="find", opening_vocab=vocab)
    assert state.forced_text() == ("<" if alone else None)
    state.feed(1, "<")
    assert state.forced_text() is None  # "<" alone fixes nothing more
    no_rule = DAState(LAYOUT, ["some chunk text"], focus_form="find")
    assert no_rule.forced_text() is None


def test_opens_alone_reads_the_tokenizers_own_tokenisation(smol_tokenizer):
    class WholeTags:
        """Each tag a token of its own (as da-tiny's vocabulary has them)."""

        tags = ("<focus", "<global>", "<local>", "<answer>")

        def encode(self, text, add_special_tokens=False):
            return [self.tags.index(text)]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.tags[i] for i in ids)

    assert opens_alone(smol_tokenizer)
    assert not opens_alone(WholeTags())
    assert OpeningVocab.from_texts(TEXTS).opens_alone is False  # unless a tokenizer says so


def test_a_tokenizer_with_no_tag_opening_is_refused():
    with pytest.raises(ValueError, match="no token of this tokenizer can begin a tag"):
        OpeningConstraint(())


LAYOUT = Layout(prompt_len=64, sink=Span(0, 4), chunks=(Span(4, 40),), question=Span(40, 64))
INNER = {1: "<", 6: "<answer>", 13: "answer", 14: ">", 15: "ans", 16: "answer>", 17: " <", 4: "Hi"}


def after_find(tag: str, **kwargs) -> DAState:
    vocab = OpeningVocab.from_texts(TEXTS, INNER)
    state = DAState(LAYOUT, ["the harbour log"], focus_form="both", **kwargs,
                    answer_vocab=vocab)
    state.feed(0, tag)
    return state


def allowed(state: DAState) -> set[int]:
    (c,) = [c for c in state.constraints if isinstance(c, AnswerNextConstraint)]
    ids = c.allowed_ids(state.reader.pending)
    return set() if ids is None else {int(i) for i in ids}


def test_the_answer_follows_a_find_focus_at_once():
    state = after_find('<focus find="harbour log">')
    assert state.due_answer() == state.forced_text() == "<answer>"
    assert allowed(state) == {1, 6}  # "<" and "<answer>": starts of it, as written mid-reply
    state.feed(1, "<")
    assert state.due_answer() == "answer>" and allowed(state) == {13, 15, 16}
    state.feed(13, "answer")
    assert state.forced_text() == ">" and allowed(state) == {14}
    state.feed(14, ">")
    assert state.mode.value == "answer" and state.due_answer() is None and allowed(state) == set()


def test_whitespace_after_the_tag_still_owes_the_answer():
    state = after_find('<focus find="harbour log">\n')
    assert state.due_answer() == "<answer>"


def test_no_answer_is_owed_after_an_id_focus_a_declined_find_or_with_the_rule_off():
    assert after_find('<focus magic_chunks="1">').due_answer() is None
    declined = after_find('<focus find="no such words anywhere">')
    assert declined.declines and declined.due_answer() is None
    off = DAState(LAYOUT, ["the harbour log"], focus_form="find")
    off.feed(0, '<focus find="harbour log">')
    assert off.due_answer() is None and off.forced_text() is None
    assert after_find('<focus find="harbour log">the').due_answer() is None  # prose began
