"""Jump-forward: tag text the protocol fixes goes in one forward. What each row reads is
still its own step's scope (read counter == view per row), live accounting still equals
replay, a forward counts once, and on the shipped model the greedy text is the text of
step-by-step decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harbour import CONTEXT, QUESTION

from declattn.api import Engine
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.engine.controller import Delegating
from declattn.engine.sampler import SamplingParams

ECONOMY = DAOptions.economy(target=96, cap=128, min_context=0)
SCRIPT = '<focus find="day 5 notes calm water, 15 boats"><answer>15</answer>'


class Script(Delegating):
    """Writes ``text`` whatever the model says: each sampled token is the tokenizer's
    first token of what is left of it (forced tokens, jump-forward's, count as written)."""

    def __init__(self, inner, tokenizer, text: str) -> None:
        super().__init__(inner)
        self.tokenizer, self.text, self.written = tokenizer, text, ""

    def process_logits(self, logits):
        logits = self.inner.process_logits(logits)
        rest = self.text[len(self.written):]
        ids = self.tokenizer.encode(rest, add_special_tokens=False) if rest else [0]
        out = logits.new_full(logits.shape, float("-inf"))
        out[ids[0]] = 0.0
        return out

    def on_token(self, token_id, text):
        self.written += text
        return self.inner.on_token(token_id, text)


@pytest.fixture(scope="module")
def engine(random_smol_model) -> Engine:
    return Engine(random_smol_model, kv_tokens=8192)


def scripted(engine: Engine, options: DAOptions):
    sess = engine.session(CONTEXT, QUESTION, options=options)
    ctl = Script(sess, engine.tokenizer, SCRIPT)
    seq = engine.add(ctl, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in engine.run(seq):
        pass
    return sess, seq


def test_fixed_tag_text_goes_in_fewer_forwards_and_reads_what_its_rows_read(engine):
    sess, seq = scripted(engine, ECONOMY)
    step_sess, step_seq = scripted(engine, dataclasses.replace(ECONOMY, jump_forward=False))
    assert sess.text == step_sess.text == SCRIPT
    assert sess.answer == "15" and seq.finish_reason == "answer"
    forced = [r for r in seq.reads if r.forced]
    assert forced, "some tag text must have been forced"
    forwards = len(seq.reads) - len(forced)
    assert forwards < len(step_seq.reads)
    # every row that ran, forced or not, read exactly its view; the rows of the last
    # forced tokens (``</answer>``) never run, since the reply ends with them, but they
    # are counted as their steps would be (as replay counts every token)
    views = {st.length: v for st, v in zip(sess.steps, sess.expected_views, strict=True)}
    for read in seq.reads:
        assert read.blocks == views[read.length]
    unrun = sorted(set(views) - {r.length for r in seq.reads})
    assert unrun and min(unrun) > max(r.length for r in seq.reads)
    # KV bytes: a forward's gather counts once, on its first row
    assert sum(r.global_bytes for r in seq.reads) < sum(r.global_bytes for r in step_seq.reads)
    ans = engine.answer_of(sess, seq)
    assert ans.stats.decode_steps == forwards


def test_live_equals_replay_with_forced_tokens(engine):
    sess, seq = scripted(engine, ECONOMY)
    rep = replay(sess.layout, seq.token_texts, block_size=engine.block_size,
                 chunk_texts=[c.text for c in sess.chunks], scaffold_local=True)
    assert [s.to_dict() for s in rep.steps] == [s.to_dict() for s in sess.steps]
    assert "".join(seq.token_texts) == sess.text


def test_the_opening_lt_sign_is_computed_with_the_prompt(engine):
    """An economical reply must open with a tag, so its ``<`` is fixed: it is accepted
    before the first sample and its row runs in the forward that completes the prompt,
    reading its own view (the read counter == the view), with no decode forward."""
    sess, seq = scripted(engine, ECONOMY)
    lt = engine.tokenizer.encode("<", add_special_tokens=False)
    assert seq.output_ids[: len(lt)] == lt and seq.reads[0].forced
    assert seq.reads[0].blocks == sess.expected_views[0]
    _, step_seq = scripted(engine, dataclasses.replace(ECONOMY, jump_forward=False))
    assert not step_seq.reads[0].forced and step_seq.output_ids[: len(lt)] == lt


def test_off_means_one_decode_step_a_token(engine):
    sess, seq = scripted(engine, dataclasses.replace(ECONOMY, jump_forward=False))
    assert not any(r.forced for r in seq.reads)
    assert len(seq.reads) == len(seq.output_ids) - 1


@pytest.mark.slow
def test_greedy_text_equals_step_by_step_on_the_shipped_model() -> None:
    """qwen2.5-0.5b, zero-shot, the economical prompt over a planted document: the reply
    with jump-forward is the reply decoded one token at a time, up to its ``</answer>``
    (where the reply ends; one token at a time, the token that closes the tag may carry
    a character or two past it, ``></``, which forcing the closing text avoids)."""
    from declattn.corpora.essays import planted_document, planted_fact
    from declattn.protocol.segment import token_counter

    eng = Engine.from_pretrained("qwen2.5-0.5b", dtype="fp32", kv_disk=False)
    texts = []
    for seed in (301,):
        fact, question, _ = planted_fact(seed)
        doc = planted_document(token_counter(eng.tokenizer), 1500, fact, seed)
        for jump in (True, False):
            o = DAOptions.economy(target=512, cap=640, min_context=0, jump_forward=jump)
            ans = eng.open(doc.text, o).ask(question, max_tokens=48)
            end = ans.text.find("</answer>")
            texts.append(ans.text[: end + len("</answer>")] if end >= 0 else ans.text)
        assert texts[-2] == texts[-1]
        assert "<focus find=" in texts[-1]  # the model wrote tags: forcing had work to do


def test_an_economy_reply_cannot_end_before_its_answer(engine):
    """Once a tag is written, the end of the response is banned until ``<answer>`` is
    open (``require_answer``): a model that would stop right after its focus block
    writes on instead. Before any tag the reply is a plain answer and may end."""
    from declattn.api.constrained import constrain

    sess = engine.session(CONTEXT, QUESTION, options=ECONOMY)
    end = engine.tokenizer.eos_token_id
    assert end not in sess.state.banned_ids()
    sess.state.feed(0, '<focus find="15 boats">15 boats</focus>')
    assert end in sess.state.banned_ids()
    logits = torch.zeros(len(engine.tokenizer))
    logits[end] = 10.0  # the model wants to stop
    row = constrain(sess.state.constraints, logits, "", 0, sess.state.banned_ids())
    assert int(row.argmax()) != end and torch.isneginf(row[end])
    for k, text in enumerate(['<focus find="day 5">', "15", "<answer>"]):
        sess.on_token(k, text)
    assert sess.state.banned_ids() == ()  # the answer is open: it may end
    no_guard = dataclasses.replace(ECONOMY, require_answer=False)
    off = engine.session(CONTEXT, QUESTION, options=no_guard)
    assert off.state.banned_ids() == ()


class Prefix(Script):
    """Writes ``text`` first, then leaves the model (random weights) to its own choice."""

    def process_logits(self, logits):
        if len(self.written) >= len(self.text):
            return self.inner.process_logits(logits)
        return super().process_logits(logits)


@pytest.mark.parametrize("jump", [True, False])
def test_the_answer_follows_a_find_focus_whatever_the_model_would_write(engine, jump):
    """``answer_after_find``: after a find focus's tag, ``<answer>`` comes next, appended
    in one forward (jump-forward) or held by the constraint token by token; with the
    rule off the random model writes something else there."""
    tag = '<focus find="day 5 notes calm water">'

    def reply(options: DAOptions) -> str:
        sess = engine.session(CONTEXT, QUESTION, options=options)
        seq = engine.add(Prefix(sess, engine.tokenizer, tag),
                         SamplingParams(max_tokens=24, ignore_eos=True))
        for _ in engine.run(seq):
            pass
        assert sess.declarations[0].phrase == "day 5 notes calm water"
        return sess.text[len(tag):]

    options = dataclasses.replace(ECONOMY, jump_forward=jump)
    assert reply(options).startswith("<answer>")
    assert not reply(dataclasses.replace(options, answer_after_find=False)).startswith("<")


@pytest.mark.parametrize("jump", [True, False])
def test_a_find_phrase_that_names_one_chunk_is_closed(engine, jump):
    """``close_find_at_one_chunk``: once the phrase names one chunk for good, the close
    comes next (appended with jump-forward, held by the find constraint without it) and
    the focus is that chunk; without the rule the random model writes on."""
    head = '<focus find="day 5'  # "day" is in five chunks; "day 5" in one, whole words

    def reply(options: DAOptions):
        sess = engine.session(CONTEXT, QUESTION, options=options)
        seq = engine.add(Prefix(sess, engine.tokenizer, head),
                         SamplingParams(max_tokens=24, ignore_eos=True))
        for _ in engine.run(seq):
            pass
        return sess

    on = reply(dataclasses.replace(ECONOMY, jump_forward=jump, close_find_at_one_chunk=True))
    assert on.text.startswith(head + '"')
    decl = on.declarations[0]
    assert decl.phrase == "day 5" and decl.accepted and len(decl.focus_ids) == 1
    assert on.state.finder.resolve(decl.phrase).ids == decl.focus_ids
    off = reply(dataclasses.replace(ECONOMY, jump_forward=jump))
    assert not off.text.startswith(head + '">')  # the random model writes on
