"""Generated tasks: one answer, evidence where recorded, prompts the engine would build."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.da.replay import replay
from declattn.protocol.segment import segment, token_counter
from declattn.train.data import da_tiny_options, encode, paragraph_chunks_of
from declattn.train.tasks import CHUNK_TOKENS, make_episode, make_episodes, wrong_chunk


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 64), two_hop=st.booleans())
def test_evidence_sits_in_the_recorded_chunk_and_the_answer_is_unique(seed, n, two_hop) -> None:
    e = make_episode(random.Random(seed), n, two_hop)
    assert len(e.paragraphs) == n
    assert len(e.hops) == (2 if two_hop else 1)
    for fact in e.hops:
        assert f"{fact.key} {fact.value} ." in e.paragraphs[fact.chunk - 1]
    keys = [w for p in e.paragraphs for w in p.split() if w.startswith("e")][::2]
    assert len(keys) == len(set(keys)) == 2 * n  # one fact per key: one answer
    if two_hop:
        first, second = e.hops
        assert second.key == first.value and second.chunk != first.chunk
    assert e.answer == e.hops[-1].value
    assert e.target.endswith(f"<answer> {e.answer}</answer>")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 20), kinds=st.lists(st.booleans(), min_size=1,
                                                                         max_size=10))
def test_several_questions_share_a_document_and_use_disjoint_facts(seed, n, kinds) -> None:
    if n == 1:
        kinds = [False, *kinds[1:]]
    eps = make_episodes(random.Random(seed), n, kinds)
    assert 1 <= len(eps) <= len(kinds)
    assert len({e.paragraphs for e in eps}) == 1
    facts = [f for e in eps for f in e.hops]
    assert len(set(facts)) == len(facts)
    for e in eps:  # each question's facts are really in the final document
        for fact in e.hops:
            assert f" {fact.key} {fact.value} ." in " " + e.paragraphs[fact.chunk - 1]
    assert all(not p.startswith("e") for p in eps[0].paragraphs)  # entities keep their space


def test_the_target_declares_the_evidence_chunks() -> None:
    e = make_episode(random.Random(3), 9, True)
    texts = list(e.target)  # one character per "token": the reader must not care
    from declattn.protocol.layout import Layout, Span

    layout = Layout(100, Span(0, 2), tuple(Span(2 + 9 * i, 11 + 9 * i) for i in range(9)),
                    Span(90, 100))
    decls = replay(layout, texts).declarations
    focus = [d.focus_ids for d in decls if d.kind == "focus"]
    assert focus == [(c,) for c in e.evidence_chunks]
    assert all(d.accepted for d in decls)


@pytest.mark.parametrize("n", [1, 7, 16, 64])
def test_the_segmenter_gives_the_paragraphs_back(tiny_tok, n) -> None:
    rng = random.Random(n)
    for _ in range(5):
        e = make_episode(rng, n, n > 1)
        chunks = segment(e.context, token_counter(tiny_tok), CHUNK_TOKENS, CHUNK_TOKENS)
        assert [c.text.rstrip("\n") for c in chunks] == list(e.paragraphs)
        assert [c.text for c in chunks] == [c.text for c in paragraph_chunks_of(e)]


def test_encoded_examples_have_no_unknown_words_and_loss_only_on_outputs(tiny_tok) -> None:
    e = make_episode(random.Random(1), 16, False)
    ex = encode(tiny_tok, e, da_tiny_options())
    assert tiny_tok.unk_token_id not in ex.input_ids
    p = ex.layout.prompt_len
    assert all(label == -100 for label in ex.labels[: p - 1])
    targets = ex.labels[p - 1 :]
    assert tiny_tok.decode(targets) == e.target
    assert ex.input_ids[p:] == targets[:-1]  # teacher forcing: inputs are shifted targets


def test_wrong_chunk_avoids_all_evidence() -> None:
    rng = random.Random(0)
    for _ in range(50):
        e = make_episode(rng, 3, True)
        assert wrong_chunk(e, rng, 3) not in e.evidence_chunks


def test_impossible_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="2-hop"):
        make_episode(random.Random(0), 1, True)
    with pytest.raises(ValueError, match="entities run out"):
        make_episode(random.Random(0), 200, False)
