"""The forced-wrong-chunk control: every focused read (a focus block, an answer inside
one) goes to a chunk that holds none of the evidence; the other steps are untouched."""

from __future__ import annotations

import random

import pytest

from declattn.da.options import DAOptions
from declattn.eval.controls import NoControl, WrongFocusSession
from declattn.protocol.instruction import BRIEF_INSTRUCTION
from declattn.train.data import tiny_tokenizer
from declattn.train.tasks import CHUNK_TOKENS, make_episode

OPTIONS = DAOptions(target=CHUNK_TOKENS, cap=CHUNK_TOKENS, sink=4, style="inline",
                    instruction=BRIEF_INSTRUCTION, focus="find", scaffold_local=True)


@pytest.fixture(scope="module")
def tok() -> object:
    return tiny_tokenizer()


def test_focused_reads_go_to_a_chunk_without_the_evidence(tok: object) -> None:
    episode = make_episode(random.Random(3), 6, False)
    fact = episode.hops[0]
    para = episode.paragraphs[fact.chunk - 1]
    at = episode.context.index(para)
    sess = WrongFocusSession(tok, episode.context, episode.question, OPTIONS, 16,
                             evidence=[(at, at + len(para))])
    assert len(sess.chunks) == 6 and sess.wrong != fact.chunk
    for text in (f'<focus find="{fact.key} {fact.value}">', "<answer>"):
        for piece in text:
            sess.state.feed(-1, piece)
        real, forced = sess.state.scope(), sess.scope()
        assert real.focus_ids == (fact.chunk,)  # what the model declared
        assert forced.mode is real.mode and forced.focus_ids == (sess.wrong,)
    for piece in f"{fact.value}</answer>":
        sess.state.feed(-1, piece)
    assert sess.scope() == sess.state.scope() and not sess.scope().focus_ids


def test_a_sample_without_evidence_has_no_control(tok: object) -> None:
    episode = make_episode(random.Random(3), 6, False)
    with pytest.raises(NoControl):
        WrongFocusSession(tok, episode.context, episode.question, OPTIONS, 16, evidence=[])
