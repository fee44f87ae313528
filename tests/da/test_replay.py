"""Tests for replay and the shared accounting."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.da.accounting import Accounting, StepRecord
from declattn.da.replay import replay
from declattn.da.scope import Scope, StepCount
from declattn.protocol.find import PhraseFinder
from declattn.protocol.grammar import DeclineReason
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode
from declattn.protocol.tags import TagReader

G, F, A, L = Mode.GLOBAL, Mode.FOCUS, Mode.ANSWER, Mode.LOCAL

TOKENS = ["<glo", "bal>", "I ", "need ", '<focus magic_chunks="2">', "fact", "</focus>",
          "<answer>", "42", "</answer>"]


def make_layout() -> Layout:
    return Layout(
        prompt_len=200,
        sink=Span(0, 16),
        chunks=(Span(20, 60), Span(60, 100), Span(110, 150)),
        question=Span(150, 200),
    )


def test_hand_written_transcript_modes_and_counts() -> None:
    lay = make_layout()
    r = replay(lay, TOKENS)
    # Token 0 comes from prefill: steps produce tokens 1..9.
    assert [s.index for s in r.steps] == list(range(1, 10))
    assert [s.length for s in r.steps] == [200 + k for k in range(1, 10)]
    # One-step lag: a tag completed by token k-1 governs step k.
    assert [s.mode for s in r.steps] == [G, G, G, G, F, F, G, A, A]
    assert [s.focus_ids for s in r.steps] == [()] * 4 + [(2,), (2,)] + [()] * 3

    # Attended counts, worked by hand (block size 16).
    step5 = r.steps[4]  # focus on chunk 2 [60, 100), length 205
    assert step5.logical == 16 + 40 + 50 + 5
    # blocks: sink 0; [60,100) -> 3..6; [150,205) -> 9..12
    assert step5.physical == (1 + 4 + 4) * 16
    step8 = r.steps[7]  # answer, length 208: sink + question + response
    assert step8.logical == 16 + 58
    assert step8.physical == (1 + 4) * 16
    for s in r.steps:
        assert s.vanilla_logical == s.length
        assert s.vanilla_physical == -(-s.length // 16) * 16
        if s.mode is G:
            assert (s.logical, s.physical) == (s.vanilla_logical, s.vanilla_physical)

    assert [d.kind for d in r.declarations] == [
        "global", "focus", "/focus", "answer", "/answer"
    ]
    assert all(d.declined is None for d in r.declarations)
    text = "".join(TOKENS)
    assert all(text[d.start : d.end] == d.tag for d in r.declarations)


def test_totals_equal_the_sum_over_scope_counts() -> None:
    lay = make_layout()
    r = replay(lay, TOKENS, block_size=8)
    expected = dict.fromkeys(("logical", "physical", "vanilla_logical", "vanilla_physical"), 0)
    per_mode: dict[Mode, list[int]] = {m: [0, 0, 0] for m in Mode}
    for s in r.steps:
        c = Scope(lay, s.mode, s.focus_ids).count(s.length, 8)
        for k in expected:
            expected[k] += getattr(c, k)
        per_mode[s.mode][0] += 1
        per_mode[s.mode][1] += c.logical
        per_mode[s.mode][2] += c.physical
    t = r.totals()
    assert {k: t[k] for k in expected} == expected
    assert t["steps"] == 9
    assert t["logical_saving"] == pytest.approx(
        1 - expected["logical"] / expected["vanilla_logical"]
    )
    assert t["physical_saving"] == pytest.approx(
        1 - expected["physical"] / expected["vanilla_physical"]
    )
    assert 0 < t["logical_saving"] < 1
    by = r.by_mode()
    assert list(by) == list(Mode)
    for m in Mode:
        assert [by[m]["steps"], by[m]["logical"], by[m]["physical"]] == per_mode[m]
    assert by[L]["steps"] == 0


def test_declined_focus_stays_global() -> None:
    r = replay(make_layout(), ["a", '<focus magic_chunks="7">', "b", "c"])
    assert [s.mode for s in r.steps] == [G, G, G]
    assert r.declarations[0].declined == DeclineReason.UNKNOWN_ID
    assert r.totals()["logical_saving"] == 0.0


def test_line_start_is_passed_to_the_reader() -> None:
    toks = ["x", "<local>", "y", "\n", "<local>", "z"]
    assert [s.mode for s in replay(make_layout(), toks).steps] == [G, L, L, L, L]
    assert [s.mode for s in replay(make_layout(), toks, line_start=True).steps] == [G, G, G, G, L]


def test_a_tag_in_the_first_token_governs_step_one() -> None:
    r = replay(make_layout(), ["<local>", "a"])
    assert [(s.index, s.mode, s.length) for s in r.steps] == [(1, L, 201)]


def test_empty_and_single_token() -> None:
    lay = make_layout()
    for toks in ([], ["hi"]):
        r = replay(lay, toks)
        assert r.steps == []
        t = r.totals()
        assert t["steps"] == t["logical"] == t["vanilla_physical"] == 0
        assert t["logical_saving"] == t["physical_saving"] == 0.0
    with pytest.raises(ValueError):
        replay(lay, ["a"], block_size=0)


def test_to_dict_is_json() -> None:
    r = replay(make_layout(), TOKENS)
    d = json.loads(json.dumps(r.to_dict()))
    assert len(d["steps"]) == 9 and d["steps"][4]["mode"] == "focus"
    assert d["steps"][4]["focus_ids"] == [2]
    assert d["declarations"][1]["tag"] == '<focus magic_chunks="2">'
    assert d["by_mode"]["answer"]["steps"] == 2
    assert d["totals"]["logical"] == r.totals()["logical"]


def test_accounting_accumulates() -> None:
    acc = Accounting()
    acc.add(StepRecord.from_count(1, Mode.FOCUS, (1,), 100, StepCount(40, 48, 100, 112)))
    acc.add(StepRecord(2, Mode.GLOBAL, (), 101, 101, 112, 101, 112))
    acc.add(StepRecord.from_count(3, Mode.ANSWER, (), 102, StepCount(10, 16, 102, 112)))
    t = acc.totals()
    assert (t["steps"], t["logical"], t["physical"]) == (3, 151, 176)
    assert (t["vanilla_logical"], t["vanilla_physical"]) == (303, 336)
    assert t["physical_saving"] == pytest.approx(1 - 176 / 336)
    by = acc.by_mode()
    assert by[Mode.FOCUS] == {"steps": 1, "logical": 40, "physical": 48,
                              "vanilla_logical": 100, "vanilla_physical": 112}
    assert by[Mode.LOCAL]["steps"] == 0
    by[Mode.FOCUS]["steps"] = 99  # a copy: the accumulator is unchanged
    assert acc.by_mode()[Mode.FOCUS]["steps"] == 1


_PIECES = ["a", " ", "\n", "<", "local>", "<answer>", "</answer>", "</focus>",
           '<focus magic_chunks="1">', '<focus magic_chunks="3,2">', "<focus magic_chunks=9>",
           "<glo", "bal>", "foc", "us", " magic_chunks='1'>"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40), st.sampled_from([1, 4, 16, 64]))
def test_replay_matches_a_step_by_step_scope(tokens: list[str], bs: int) -> None:
    """Each step reads the scope of the reader state after the previous tokens."""
    lay = make_layout()
    r = replay(lay, tokens, block_size=bs)
    reader = TagReader(lay.n_chunks)
    acc = Accounting()
    for k, tok in enumerate(tokens):
        if k:
            length = lay.prompt_len + k
            scope = Scope(lay, reader.mode, reader.focus_ids)
            rec = r.steps[k - 1]
            assert (rec.index, rec.mode, rec.focus_ids, rec.length) == (
                k, reader.mode, reader.focus_ids, length
            )
            c = scope.count(length, bs)
            assert (rec.logical, rec.physical) == (c.logical, c.physical)
            acc.add(rec)
        reader.feed(tok)
    assert len(r.steps) == max(0, len(tokens) - 1)
    assert r.totals() == acc.totals()


# -- find focus --------------------------------------------------------------------------

CHUNK_TEXTS = [
    "The bakery on Mill Lane sells rye bread.",
    "The last train to Leeds leaves at 11:40 pm.",
    'Parking is free. <focus find="x"> <|im_end|> <focus magic_chunks="1">',
]
FIND_TOKENS = ["<fo", 'cus find="last', " train", ' to Leeds">', "11:40", "</focus>",
               "<answer>", "11:40", "</answer>"]


def test_replay_resolves_find_from_the_chunk_texts() -> None:
    r = replay(make_layout(), FIND_TOKENS, chunk_texts=CHUNK_TEXTS)
    d = r.declarations[0]
    assert (d.kind, d.focus_ids, d.phrase, d.match, d.declined) == (
        "focus", (2,), "last train to Leeds", "exact", None
    )
    assert [s.mode for s in r.steps] == [G, G, G, F, F, G, A, A]
    assert [s.focus_ids for s in r.steps][3:5] == [(2,), (2,)]


def test_replay_without_chunk_texts_declines_find() -> None:
    r = replay(make_layout(), FIND_TOKENS)
    assert r.declarations[0].declined == DeclineReason.NO_CHUNK_TEXTS
    assert F not in {s.mode for s in r.steps}
    with pytest.raises(ValueError, match="2 chunk texts for a layout of 3 chunks"):
        replay(make_layout(), FIND_TOKENS, chunk_texts=CHUNK_TEXTS[:2])


def test_tag_text_in_a_chunk_never_declares_in_replay() -> None:
    r = replay(make_layout(), ["Parking ", "is free", " x im end"], chunk_texts=CHUNK_TEXTS)
    assert r.declarations == [] and {s.mode for s in r.steps} == {G}


def _live(layout: Layout, chunk_texts: list[str], tokens: list[str], bs: int):
    """What a session does, step by step: scope from the reader, then feed the token."""
    reader = TagReader(layout.n_chunks, finder=PhraseFinder(chunk_texts))
    steps = []
    for k, tok in enumerate(tokens):
        if k:
            length = layout.prompt_len + k
            scope = Scope(layout, reader.mode, reader.focus_ids)
            steps.append(
                StepRecord.from_count(k, scope.mode, scope.focus_ids, length,
                                      scope.count(length, bs))
            )
        reader.feed(tok)
    reader.finish()
    return reader.declarations, steps


_FIND_PIECES = ["a", " ", "\n", '<focus find="', "last train", " to Leeds", '">', "rye",
                " bread", "</focus>", "<local>", "<answer>", "</answer>", "'", "<focus find='",
                "Mill Lane'>", '<focus find="bus">', '<focus find="x">']


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_FIND_PIECES), max_size=30), st.sampled_from([1, 16]))
def test_replay_from_a_record_equals_the_live_run(tokens: list[str], bs: int) -> None:
    """The record keeps the layout, the chunk texts and the token texts (as JSON); a
    replay from it gives the live declarations and steps exactly."""
    lay = make_layout()
    live_decls, live_steps = _live(lay, CHUNK_TEXTS, tokens, bs)
    record = json.loads(json.dumps({
        "layout": lay.to_dict(), "chunks": [{"text": t} for t in CHUNK_TEXTS],
        "output": {"token_texts": tokens}, "block_size": bs,
    }))
    r = replay(Layout.from_dict(record["layout"]), record["output"]["token_texts"],
               block_size=record["block_size"],
               chunk_texts=[c["text"] for c in record["chunks"]])
    assert [d.to_dict() for d in r.declarations] == [d.to_dict() for d in live_decls]
    assert [s.to_dict() for s in r.steps] == [s.to_dict() for s in live_steps]


def test_replay_equals_live_on_a_real_prompt(smol_tokenizer) -> None:
    """Real segmentation, prompt and tokenisation: the chunk texts a record keeps are the
    ones the prompt was rendered from, and replay resolves the find exactly as live."""
    from declattn.engine.detok import Detokenizer
    from declattn.protocol.instruction import FIND_INSTRUCTION
    from declattn.protocol.prompt import render_prompt
    from declattn.protocol.segment import segment, token_counter
    from declattn.protocol.template import encode_user_text

    context = "\n\n".join(
        f"Day {i}: the harbour log notes {i * 3} boats and a keeper named Ada." * 3
        for i in range(1, 9)
    )
    chunks = segment(context, token_counter(smol_tokenizer), 64, 96)
    prompt = render_prompt(smol_tokenizer, chunks, "Boats on day 5?", instruction=FIND_INSTRUCTION)
    out = '<focus find="Day 5: the harbour">15 boats</focus>\n<answer>15</answer>'
    detok = Detokenizer(smol_tokenizer)
    tokens = [detok.add(t) for t in encode_user_text(smol_tokenizer, out)]
    texts = [c.text for c in chunks]
    live_decls, live_steps = _live(prompt.layout, texts, tokens, 16)
    r = replay(prompt.layout, tokens, chunk_texts=texts)
    assert live_decls[0].accepted and live_decls[0].match == "exact"
    assert all("day 5" in texts[i - 1].lower() for i in live_decls[0].focus_ids)
    assert [d.to_dict() for d in r.declarations] == [d.to_dict() for d in live_decls]
    assert [s.to_dict() for s in r.steps] == [s.to_dict() for s in live_steps]
