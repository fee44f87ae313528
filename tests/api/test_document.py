"""``Engine.open``: one document, many questions, prefilled once; ``Chat``: turns that
accumulate; ``min_context``: a short context runs vanilla and says so."""

from __future__ import annotations

import dataclasses

import pytest

from declattn.api import Engine
from declattn.api.session import DASession, PlainSession
from declattn.da.options import DAOptions
from declattn.engine.sampler import SamplingParams
from declattn.protocol.segment import token_counter

CONTEXT = "\n\n".join(
    f"Entry {i}: the harbour master counted {10 + i} boats at the pier on day {i}." * 3
    for i in range(40)
)  # about 2,000 tokens


@pytest.fixture(scope="module")
def engine(random_smol_model) -> Engine:
    return Engine(random_smol_model, kv_tokens=16384)


def options(engine: Engine):
    return dataclasses.replace(engine.da_defaults, target=256, cap=320, constrain=False,
                               min_context=0)


def test_questions_over_one_document_reuse_its_prefill(engine: Engine) -> None:
    doc = engine.open(CONTEXT, options(engine))
    a1 = doc.ask("How many boats on day 3?", max_tokens=6)
    a2 = doc.ask("How many boats on day 30?", max_tokens=6)
    assert a1.stats.cached_tokens == 0 and a2.stats.cached_tokens >= 1536
    fresh = engine.with_pool(1024, prefix_caching=False).open(CONTEXT, options(engine))
    again = fresh.ask("How many boats on day 30?", max_tokens=6)
    assert again.stats.cached_tokens == 0
    assert again.text == a2.text  # reuse changes no token
    assert a2.session.chunks == doc.chunks  # cut once, for every question
    vanilla = doc.ask("How many boats on day 30?", da=False, max_tokens=6)
    assert isinstance(vanilla.session, PlainSession)


def test_a_chat_keeps_its_turns_in_the_prompt_and_in_every_mode(engine: Engine) -> None:
    chat = engine.open(CONTEXT, options(engine)).chat()
    first = chat.ask("How many boats on day 3?", max_tokens=6)
    second = chat.ask("And on day 4?", max_tokens=6)
    assert chat.turns == [("How many boats on day 3?", first.text), ("And on day 4?", second.text)]
    sess = second.session
    assert isinstance(sess, DASession)
    lay = sess.layout
    # the earlier turn sits in the question window: read in every mode, like the response
    turn_text = engine.tokenizer.decode(sess.prompt_ids[lay.question.start : lay.prompt_len])
    assert "How many boats on day 3?" in turn_text and "And on day 4?" in turn_text
    assert second.stats.cached_tokens >= first.stats.prompt_tokens - 512


def test_a_context_under_min_context_runs_vanilla_and_says_so(engine: Engine) -> None:
    o = dataclasses.replace(options(engine), min_context=100_000)
    ans = engine.answer(CONTEXT, "How many boats?", options=o, max_tokens=4)
    assert ans.arm == "vanilla" and ans.note is not None and "min_context" in ans.note
    assert isinstance(ans.session, PlainSession)
    o = dataclasses.replace(o, min_context=10)
    assert engine.answer(CONTEXT, "How many boats?", options=o, max_tokens=4).arm == "da"


def test_by_default_the_gate_weighs_the_whole_reply(engine: Engine) -> None:
    """No ``min_context``: DA runs where its whole reply is expected to read fewer bytes
    than the plain reply. The chunk-id protocol's long reply, with a global survey, never
    does; the economical reply (a find focus, the answer inside it) does once the
    context outweighs the extra forwards, and the request follows that decision."""
    classic = DAOptions(target=256, cap=320, constrain=False)
    ans = engine.answer(CONTEXT, "How many boats?", options=classic, max_tokens=4)
    assert ans.arm == "vanilla" and "expected to read" in (ans.note or "")
    assert engine.reply_cost(2000, classic).ratio > 1
    economy = DAOptions.economy(target=256, cap=320, constrain=False)
    ratios = [engine.reply_cost(n, economy).ratio for n in (500, 2000, 8000, 32000)]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1
    n = token_counter(engine.tokenizer)(CONTEXT)
    ans = engine.answer(CONTEXT, "How many boats?", options=economy, max_tokens=4)
    assert ans.arm == ("da" if engine.reply_cost(n, economy).run_da else "vanilla")


def test_the_gate_counts_the_requests_that_share_the_steps(engine: Engine) -> None:
    """Requests already in the engine share each forward's weights with a new one, so the
    gate weighs the DA reply as one of a batch, and its note says beside how many."""
    economy = DAOptions.economy(target=256, cap=320, constrain=False)
    assert engine.reply_cost(8000, economy, batch=8).ratio < engine.reply_cost(8000, economy).ratio
    other = engine.session(CONTEXT, "How many gulls?", da=False)
    req = engine.add(other, SamplingParams(max_tokens=64, ignore_eos=True))
    classic = DAOptions(target=256, cap=320, constrain=False)
    note = engine.session(CONTEXT, "How many boats?", options=classic).note
    assert note is not None and "beside 1 other requests" in note
    engine.abort(req)
    told = engine.session(CONTEXT, "How many boats?", options=classic, batch=3).note
    assert told is not None and "beside 2 other requests" in told  # a caller that knows
