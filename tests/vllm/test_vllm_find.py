"""The find focus in the vLLM plugin, without vLLM: the request args carry the focus form,
the request builder renders the find instruction as our engine does, and the engine
core's tracker rebuilds the chunk texts from the prompt's chunk spans and resolves,
reads and constrains a ``<focus find="WORDS">`` exactly as ``DASession`` does."""

from __future__ import annotations

import pytest
import torch
from phrases import naming_phrase

from declattn.api.session import DASession
from declattn.da.constrain_find import FindVocab
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.da.scope import Scope
from declattn.protocol.grammar import DeclineReason
from declattn.protocol.modes import Mode
from declattn.vllm.request import build_request
from declattn.vllm.tracker import RequestTracker, chunk_ids_of
from declattn.vllm.xargs import BadDAArgs, DASpec, parse

CONTEXT = "\n\n".join(
    f"Paragraph {i}: the harbour log for day {i} notes calm water, {i * 3} boats and "
    f"a keeper named Ada who counted gulls from the gallery." * 2
    for i in range(1, 9)
)
QUESTION = "How many boats were in the harbour on day 5?"
FIND = DAOptions(target=96, cap=128, focus="find")
BLOCK = 32


@pytest.fixture(scope="module")
def find_vocab(smol_tokenizer) -> FindVocab:
    return FindVocab.from_tokenizer(smol_tokenizer)


def unique_phrase(chunks) -> tuple[str, int]:
    """A find phrase that names chunk 3 alone, and that chunk."""
    return naming_phrase([c.text for c in chunks], 3), 3


def token_texts(tokenizer, ids) -> list[str]:
    from declattn.engine.detok import Detokenizer

    detok = Detokenizer(tokenizer)
    return [detok.add(t) for t in ids]


def test_the_focus_form_travels_in_the_request_args_and_a_bad_one_is_refused() -> None:
    req_spec = DASpec(parse_layout(), constrain=True, focus="both", label="f")
    assert parse(req_spec.to_args()) == req_spec
    assert req_spec.constraints() == (True, True)
    assert DASpec(parse_layout(), constrain=True, focus="find").constraints() == (False, True)
    assert DASpec(parse_layout(), focus="find").constraints() == (False, False)
    with pytest.raises(BadDAArgs, match="da_focus"):
        parse({**req_spec.to_args(), "da_focus": "words"})
    assert parse({k: v for k, v in req_spec.to_args().items() if k != "da_focus"}).focus == "ids"


def parse_layout():
    from declattn.protocol.layout import Layout, Span

    return Layout(prompt_len=200, sink=Span(0, 16), chunks=(Span(20, 60), Span(64, 120)),
                  question=Span(172, 200))


def test_the_request_renders_the_find_instruction_and_index_as_our_engine(smol_tokenizer) -> None:
    for options in (FIND, DAOptions(target=96, cap=128, focus="both", index=128)):
        req = build_request(CONTEXT, QUESTION, smol_tokenizer, options)
        sess = DASession(smol_tokenizer, CONTEXT, QUESTION, options)
        assert req.prompt_token_ids == sess.prompt_ids and req.layout == sess.layout
        assert req.spec.focus == options.focus
        assert options.instruction_for(sess.chunks, smol_tokenizer) in req.rendered.text
    plain = build_request(CONTEXT, QUESTION, smol_tokenizer, DAOptions(target=96, cap=128))
    assert plain.prompt_token_ids != req.prompt_token_ids  # the instruction differs


def test_a_find_focus_resolves_from_the_decoded_chunk_spans_as_our_engine_resolves_it(
    smol_tokenizer,
) -> None:
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, FIND)
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, FIND, BLOCK)
    phrase, chunk = unique_phrase(sess.chunks)
    transcript = f'<focus find="{phrase}">Day {chunk} had boats.</focus>\n<answer>15</answer>'
    ids = smol_tokenizer.encode(transcript, add_special_tokens=False)
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer,
                             chunk_ids=chunk_ids_of(req.prompt_token_ids, req.layout))
    texts = token_texts(smol_tokenizer, ids)
    lay = req.layout
    focused = 0
    for k, (token, text) in enumerate(zip(ids, texts, strict=True)):
        if k >= 1:  # the step producing token k: both read under tokens 0..k-1
            length = lay.prompt_len + k
            scope = tracker.scope()
            assert (scope.mode, scope.focus_ids) == (sess.reader.mode, sess.reader.focus_ids)
            assert tracker.kept_blocks(length, BLOCK) == tuple(sess.view(length))
            if scope.mode == Mode.FOCUS:
                focused += 1
                want = Scope(lay, Mode.FOCUS, (chunk,)).kept_blocks(length, BLOCK)
                assert scope.focus_ids == (chunk,) and tracker.kept_blocks(length, BLOCK) == \
                    tuple(want)
                assert len(want) < -(-length // BLOCK)  # the other chunks are skipped
        live.append(token)
        sess.on_token(token, text)
    assert focused > 3
    tracker.sync()
    # the engine core's chunk texts are the chunks' own texts, byte for byte
    assert tracker.state.finder is not None
    assert _finder_texts(smol_tokenizer, req) == [c.text for c in sess.chunks]
    (focus,) = [d for d in tracker.reader.declarations if d.kind == "focus"]
    assert focus.to_dict() == next(d.to_dict() for d in sess.declarations if d.kind == "focus")
    assert (focus.phrase, focus.match, focus.focus_ids) == (phrase, "exact", (chunk,))
    # and a replay from the recorded chunk texts agrees step for step
    steps = replay(lay, texts, block_size=BLOCK, chunk_texts=[c.text for c in sess.chunks]).steps
    assert [(s.mode, s.focus_ids) for s in steps] == [
        (r.mode, r.focus_ids) for r in sess.steps]


def _finder_texts(tokenizer, req) -> list[str]:
    from declattn.protocol.template import decode

    return [decode(tokenizer, ids) for ids in chunk_ids_of(req.prompt_token_ids, req.layout)]


def test_without_the_prompt_a_find_is_declined_and_the_request_stays_global(
    smol_tokenizer,
) -> None:
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, FIND)
    assert chunk_ids_of(req.prompt_token_ids[:-1], req.layout) is None  # not its prompt
    assert chunk_ids_of(None, req.layout) is None
    ids = smol_tokenizer.encode('<focus find="day 5 notes">x', add_special_tokens=False)
    tracker = RequestTracker(req.spec, ids, smol_tokenizer)
    assert tracker.wants_chunks
    scope = tracker.scope()
    assert scope.mode == Mode.GLOBAL and not tracker.wants_chunks
    (d,) = tracker.reader.declines
    assert d.declined == DeclineReason.NO_CHUNK_TEXTS
    with pytest.raises(RuntimeError):  # too late: the reader was built without them
        tracker.give_chunks(chunk_ids_of(req.prompt_token_ids, req.layout))


def test_chunk_tokens_handed_over_later_are_used_from_the_first_token(smol_tokenizer) -> None:
    """Model Runner V2's way: the tracker exists before the prompt's chunk tokens reach
    the host; they are given before its first token is read."""
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, FIND)
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, FIND, BLOCK)
    phrase, chunk = unique_phrase(sess.chunks)
    ids = smol_tokenizer.encode(f'<focus find="{phrase}">x', add_special_tokens=False)
    tracker = RequestTracker(req.spec, ids, smol_tokenizer)
    with pytest.raises(ValueError):
        tracker.give_chunks([[1, 2]])  # not one list per chunk
    tracker.give_chunks(chunk_ids_of(req.prompt_token_ids, req.layout))
    assert tracker.scope().focus_ids == (chunk,) and not tracker.wants_chunks


def test_the_find_constraint_masks_the_logits_as_our_engines_session_does(
    smol_tokenizer, find_vocab,
) -> None:
    options = DAOptions(target=96, cap=128, focus="find", constrain=True)
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, options)
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, options, BLOCK, find_vocab=find_vocab)
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer, find_vocab=find_vocab,
                             chunk_ids=chunk_ids_of(req.prompt_token_ids, req.layout))
    assert tracker.edits_logits
    ids = smol_tokenizer.encode('<focus find="day 5 no', add_special_tokens=False)
    gen = torch.Generator().manual_seed(0)
    masked_steps = 0
    for token, text in zip(ids, token_texts(smol_tokenizer, ids), strict=True):
        row = torch.randn(len(smol_tokenizer), generator=gen)
        ours, theirs = tracker.process_logits(row.clone()), sess.process_logits(row.clone())
        assert torch.equal(ours, theirs)
        masked_steps += bool(torch.isinf(ours).any())
        live.append(token)
        sess.on_token(token, text)
    row = torch.randn(len(smol_tokenizer), generator=gen)
    ours = tracker.process_logits(row.clone())
    assert torch.equal(ours, sess.process_logits(row.clone()))
    # inside the phrase only the few continuations the chunks hold survive
    allowed = int(torch.isfinite(ours).sum())
    assert 0 < allowed < len(smol_tokenizer) // 100 and masked_steps >= 3
    # the focus-id constraint is not on for a find request (DASession's rule)
    assert len(tracker.state.constraints) == len(sess.constraints) == 1


def test_the_opening_constraint_masks_the_first_row_as_our_engines_session_does(
    smol_tokenizer,
) -> None:
    """``open_tag`` travels to the tracker: its first row keeps only the tokens that
    begin a tag, the same row our session keeps; the second row is left alone."""
    options = DAOptions(target=96, cap=128, focus="find", open_tag=True)
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, options)
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, options, BLOCK)
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer)
    assert tracker.edits_logits
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(len(smol_tokenizer), generator=gen)
    ours, theirs = tracker.process_logits(row.clone()), sess.process_logits(row.clone())
    assert torch.equal(ours, theirs)
    kept = torch.isfinite(ours).nonzero().flatten().tolist()
    assert 0 < len(kept) < 1000
    assert all(smol_tokenizer.decode([i]).startswith("<") for i in kept)
    token = smol_tokenizer.encode("<", add_special_tokens=False)[0]
    live.append(token)
    sess.on_token(token, "<")
    row = torch.randn(len(smol_tokenizer), generator=gen)
    assert torch.equal(tracker.process_logits(row.clone()), row)


def test_the_answer_after_a_find_focus_is_held_as_our_engines_session_holds_it(
    smol_tokenizer,
) -> None:
    """``answer_after_find`` travels to the tracker: after a find focus's tag, its row
    keeps only the starts of ``<answer>``, the same row our session keeps (vLLM decodes
    the fixed text token by token, so the constraint is what holds it there)."""
    options = DAOptions(target=96, cap=128, focus="find", answer_after_find=True)
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, options)
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, options, BLOCK)
    phrase, _ = unique_phrase(sess.chunks)
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer,
                             chunk_ids=chunk_ids_of(req.prompt_token_ids, req.layout))
    assert tracker.edits_logits
    for token in smol_tokenizer.encode(f'<focus find="{phrase}">', add_special_tokens=False):
        live.append(token)
        sess.on_token(token, smol_tokenizer.decode(live)[len(sess.text):])
    row = torch.randn(len(smol_tokenizer), generator=torch.Generator().manual_seed(0))
    ours, theirs = tracker.process_logits(row.clone()), sess.process_logits(row.clone())
    assert torch.equal(ours, theirs)
    kept = [smol_tokenizer.decode([i]) for i in torch.isfinite(ours).nonzero().flatten()]
    assert kept and all("<answer>".startswith(t) for t in kept)
