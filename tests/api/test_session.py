"""The DA session drives the real engine path: what the attention reads equals the
scope on every step, live accounting equals replay, and all-global DA equals DA-nm."""

from __future__ import annotations

import pytest
import torch
from harbour import CONTEXT, QUESTION, TRANSCRIPT

from declattn.api import Engine
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.da.scope import Scope
from declattn.engine.controller import Forced
from declattn.engine.sampler import SamplingParams
from declattn.protocol.modes import Mode

OPTIONS = DAOptions(target=96, cap=128, min_context=0)


@pytest.fixture(scope="module")
def engine(random_smol_model) -> Engine:
    return Engine(random_smol_model, kv_tokens=8192)


def forced_run(engine, transcript, options=OPTIONS):
    sess = engine.session(CONTEXT, QUESTION, da=True, options=options)
    tokens = engine.tokenizer.encode(transcript, add_special_tokens=False)
    ctl = Forced(sess, tokens, keep_logits=True)
    params = SamplingParams(max_tokens=len(tokens), ignore_eos=True)
    seq = engine.add(ctl, params)
    for _ in engine.run(seq):
        pass
    return sess, seq, ctl


def test_reads_equal_scope_on_every_step(engine):
    sess, seq, _ = forced_run(engine, TRANSCRIPT)
    assert len(sess.chunks) >= 4
    assert len(seq.reads) == len(seq.output_ids) - 1 == len(sess.expected_views)
    for read, expected in zip(seq.reads, sess.expected_views, strict=True):
        assert read.blocks == expected
        assert read.layers_agree
    for step, view in zip(sess.steps, sess.expected_views, strict=True):
        # each view is its step's scope, made afresh (the session reuses one per block)
        scope = Scope(sess.layout, step.mode, step.focus_ids)
        assert view == tuple(scope.kept_blocks(step.length, sess.block_size))
    modes = {s.mode for s in sess.steps}
    assert {Mode.GLOBAL, Mode.FOCUS, Mode.LOCAL, Mode.ANSWER} <= modes
    focus = [s for s in sess.steps if s.mode == Mode.FOCUS]
    assert all(s.logical < s.vanilla_logical / 2 for s in focus)
    assert sess.answer == "15"
    assert seq.finish_reason == "answer"


FIND_TRANSCRIPT = (
    '<focus find="day 5 notes calm water, 15 boats">day 5 notes 15 boats</focus>\n'
    "<local>So the answer is 15.</local>\n"
    "<answer>15</answer>"
)


def test_a_find_focus_reads_exactly_the_chunks_its_phrase_resolves_to(engine):
    """The engine looks the phrase up in the chunk texts when the tag closes; from the
    next step on, the attention reads exactly the scope's blocks for those chunks (read
    counter == scope), and the chunks are the ones whose text holds the phrase."""
    options = DAOptions(target=96, cap=128, focus="find", min_context=0)
    sess, seq, _ = forced_run(engine, FIND_TRANSCRIPT, options)
    holding = [c.id for c in sess.chunks if "day 5 notes calm water, 15 boats" in c.text]
    assert holding and len(holding) < len(sess.chunks)
    focus = [d for d in sess.declarations if d.kind == "focus"]
    assert len(focus) == 1 and focus[0].declined is None
    assert sorted(focus[0].focus_ids) == holding and focus[0].match == "exact"
    assert len(seq.reads) == len(sess.expected_views)
    for read, expected in zip(seq.reads, sess.expected_views, strict=True):
        assert read.blocks == expected and read.layers_agree
    focused = [(st, r) for st, r in zip(sess.steps, seq.reads, strict=True)
               if st.mode == Mode.FOCUS]
    assert focused and all(st.focus_ids == tuple(holding) for st, _ in focused)
    bs = engine.block_size
    for span in (sess.layout.chunks[i - 1] for i in holding):
        wanted = set(range(span.start // bs, -(-span.end // bs)))
        assert all(wanted <= set(r.blocks) for _, r in focused)
    assert all(st.logical < st.vanilla_logical / 2 for st, _ in focused)


def test_live_accounting_equals_replay(engine):
    sess, seq, _ = forced_run(engine, TRANSCRIPT)
    rep = replay(sess.layout, seq.token_texts, block_size=engine.block_size)
    assert [s.to_dict() for s in rep.steps] == [s.to_dict() for s in sess.steps]
    assert rep.totals() == sess.accounting.totals()


def test_all_global_da_equals_da_without_masking(engine):
    plain = "The harbour log says there were fifteen boats on day five, I think."
    _, seq_da, ctl_da = forced_run(engine, plain)
    nm = DAOptions(target=96, cap=128, masking=False, min_context=0)
    _, seq_nm, ctl_nm = forced_run(engine, plain, nm)
    assert seq_da.output_ids == seq_nm.output_ids
    for a, b in zip(ctl_da.logits, ctl_nm.logits, strict=True):
        assert torch.equal(a, b)


def test_masking_changes_logits_from_the_first_narrow_step_on(engine):
    sess, _, ctl_da = forced_run(engine, TRANSCRIPT)
    nm = DAOptions(target=96, cap=128, masking=False, min_context=0)
    _, _, ctl_nm = forced_run(engine, TRANSCRIPT, nm)
    first = next(i for i, s in enumerate(sess.steps) if s.mode != Mode.GLOBAL)
    pairs = list(zip(sess.steps, ctl_da.logits[1:], ctl_nm.logits[1:], strict=True))
    for _, a, b in pairs[:first]:
        assert torch.equal(a, b)  # global before any narrowing: identical reads
    for step, a, b in pairs[first:]:
        if step.mode != Mode.GLOBAL:
            assert not torch.allclose(a, b, atol=1e-6)


def test_answer_api_reports_the_accounting(engine):
    ans = engine.answer(CONTEXT, QUESTION, max_tokens=12, options=OPTIONS)
    s = ans.stats
    assert s.decode_steps == s.output_tokens - 1
    assert s.vanilla_attended >= s.logical_attended > 0
    assert s.blocks_read == sum(len(v) for v in ans.session.expected_views)
    van = engine.answer(CONTEXT, QUESTION, da=False, max_tokens=12)
    assert van.stats.logical_attended == van.stats.vanilla_attended
    assert van.arm == "vanilla" and ans.arm == "da"


ECONOMY_TRANSCRIPT = '<focus find="day 5 notes calm water, 15 boats"><answer>15</answer>'


def test_scaffold_steps_read_exactly_the_local_blocks(engine):
    """With the scaffold rule, the steps that write a tag read the local scope's blocks
    (sink, question window, response) and nothing else; the answer written inside the
    focus reads the focused chunk; the read counter equals the scope on every step."""
    options = DAOptions.economy(target=96, cap=128, jump_forward=False, min_context=0)
    sess, seq, _ = forced_run(engine, ECONOMY_TRANSCRIPT, options)
    bs = engine.block_size
    assert len(seq.reads) == len(sess.expected_views) == len(sess.steps)
    for read, expected in zip(seq.reads, sess.expected_views, strict=True):
        assert read.blocks == expected and read.layers_agree
    local = [(st, r) for st, r in zip(sess.steps, seq.reads, strict=True)
             if st.mode == Mode.LOCAL]
    assert len(local) >= 5  # the find tag's words, '<answer', '</answer'
    lay = sess.layout
    for st, r in local:
        want = set()
        for span in (lay.sink, lay.question, type(lay.sink)(lay.prompt_len, st.length)):
            want |= set(range(span.start // bs, -(-span.end // bs)))
        want.add((st.length - 1) // bs)
        assert set(r.blocks) == want
    answer = [st for st in sess.steps if st.mode == Mode.ANSWER]
    assert answer and all(st.focus_ids for st in answer)
    assert sess.answer == "15" and seq.finish_reason == "answer"


def test_live_accounting_equals_replay_under_the_scaffold_rule(engine):
    options = DAOptions.economy(target=96, cap=128, jump_forward=False, min_context=0)
    sess, seq, _ = forced_run(engine, ECONOMY_TRANSCRIPT, options)
    texts = [c.text for c in sess.chunks]
    rep = replay(sess.layout, seq.token_texts, block_size=engine.block_size,
                 chunk_texts=texts, scaffold_local=True)
    assert [s.to_dict() for s in rep.steps] == [s.to_dict() for s in sess.steps]
    plain = replay(sess.layout, seq.token_texts, block_size=engine.block_size,
                   chunk_texts=texts)
    assert plain.totals()["logical"] > rep.totals()["logical"]  # the rule reads less


def test_an_economy_reply_opens_with_a_tag(engine):
    """``open_tag``: the first token, sampled from the prefill's logits, begins a tag even
    where the model's own first choice (random weights here) is anything else."""
    def first_token(open_tag: bool) -> str:
        options = DAOptions.economy(target=96, cap=128, min_context=0, open_tag=open_tag)
        sess = engine.session(CONTEXT, QUESTION, da=True, options=options)
        seq = engine.add(sess, SamplingParams(max_tokens=3, ignore_eos=True))
        for _ in engine.run(seq):
            pass
        return seq.token_texts[0]

    free, opened = first_token(False), first_token(True)
    assert not free.startswith("<")  # so the constraint below is what made the difference
    assert opened.startswith("<") and any(
        tag.startswith(opened) for tag in ('<focus find="', "<global>", "<local>", "<answer>"))
