"""The DA state machine on its own: the scaffold rule, an answer under a focus, the fixed
text of a decided tag, and the finish reasons."""

from __future__ import annotations

import pytest

from declattn.da.constrain_find import FindVocab
from declattn.da.state import DAState, fixed_continuation
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode

LAYOUT = Layout(
    prompt_len=60, sink=Span(0, 4), chunks=(Span(8, 20), Span(20, 32), Span(32, 44)),
    question=Span(48, 60),
)
TEXTS = ["the bakery sells rye bread", "the last train to leeds leaves late",
         "parking is free after six"]


def walk(pieces: list[str], scaffold_local: bool = True) -> list[tuple[str, Mode, tuple]]:
    """``(text so far, mode read, focus ids read)`` before each piece after the first, as
    the engine asks: the scope of the step that writes piece k is taken after piece k-1."""
    state = DAState(LAYOUT, TEXTS, scaffold_local=scaffold_local, focus_form="find")
    out = []
    for k, piece in enumerate(pieces):
        if k:
            scope = state.scope()
            out.append((state.text, scope.mode, scope.focus_ids))
        state.feed(k, piece)
    return out


ECONOMY = ['<focus', ' find', '="', 'last', ' train', '">', '<', 'answer', '>', 'eleven',
           ' forty', '</', 'answer', '>']


def test_tag_text_reads_as_local_and_the_answer_reads_the_focus() -> None:
    steps = walk(ECONOMY)
    modes = [(m, ids) for _, m, ids in steps]
    # writing the find tag: a candidate is pending, so every step reads as local
    assert modes[:5] == [(Mode.LOCAL, ())] * 5
    # after the tag closes: the focus (the tag's own '<' for <answer> is written here)
    assert modes[5] == (Mode.FOCUS, (2,))
    # '<answer' pending: local again, then the answer reads the focused chunk
    assert modes[6:8] == [(Mode.LOCAL, ())] * 2
    assert modes[8:11] == [(Mode.ANSWER, (2,))] * 3
    assert modes[11:] == [(Mode.LOCAL, ())] * 2  # "</answer" pending


def test_without_the_rule_the_same_steps_read_as_the_reader_says() -> None:
    steps = walk(ECONOMY, scaffold_local=False)
    assert [m for _, m, _ in steps[:5]] == [Mode.GLOBAL] * 5
    assert steps[8][1:] == (Mode.ANSWER, (2,))


def test_between_blocks_is_scaffold_but_prose_after_a_boundary_is_not() -> None:
    pieces = ['<global>', 'Chunk', ' two', '</global>', '\n', 'Then', ' more', ' text']
    steps = walk(pieces)
    assert [m for _, m, _ in steps] == [
        Mode.GLOBAL, Mode.GLOBAL, Mode.GLOBAL,  # inside the global block
        Mode.LOCAL, Mode.LOCAL,  # right after </global>, and after its newline
        Mode.GLOBAL, Mode.GLOBAL,  # 'Then' was prose: the mode's own scope again
    ]


def test_the_reply_start_is_a_boundary() -> None:
    steps = walk([' ', '\n', 'Plain', ' prose'])
    assert [m for _, m, _ in steps] == [Mode.LOCAL, Mode.LOCAL, Mode.GLOBAL]


@pytest.mark.parametrize(
    "pending, mode, heads, fixed",
    [
        ("</fo", Mode.FOCUS, (), "cus>"),
        ("</", Mode.FOCUS, (), "focus>"),  # in a focus the only closer is </focus>
        ("<an", Mode.FOCUS, (), "swer>"),
        ("<", Mode.FOCUS, (), None),  # a lone '<' may be a less-than sign
        ("</", Mode.ANSWER, (), "answer>"),
        ("<a", Mode.ANSWER, (), None),  # in an answer only </answer> is a tag
        ("</", Mode.GLOBAL, (), "global>"),
        ("<f", Mode.GLOBAL, ('<focus find="',), 'ocus find="'),
        ("<f", Mode.GLOBAL, (), None),  # no focus head taught: nothing fixed
        ("<focus ", Mode.GLOBAL, ('<focus find="', '<focus magic_chunks="'), None),
        ('<focus find="last train"', Mode.GLOBAL, (), ">"),
        ('<focus find="last train', Mode.GLOBAL, (), None),  # the phrase is the model's
        ('<focus magic_chunks="2,3"', Mode.GLOBAL, (), ">"),
        ("<l", Mode.GLOBAL, (), "ocal>"),
        ("</l", Mode.LOCAL, (), "ocal>"),
        ("</answer>", Mode.ANSWER, (), None),  # complete: nothing left
    ],
)
def test_fixed_continuation(pending, mode, heads, fixed) -> None:
    assert fixed_continuation(pending, mode, heads) == fixed


def test_forced_text_follows_the_reader() -> None:
    state = DAState(LAYOUT, TEXTS, focus_form="find")
    state.feed(0, "<f")
    assert state.forced_text() == 'ocus find="'
    state.feed(1, 'ocus find="last train"')
    assert state.forced_text() == ">"
    state.feed(2, "><an")
    assert state.mode is Mode.FOCUS and state.forced_text() == "swer>"


def test_feed_finishes_at_the_closing_answer() -> None:
    state = DAState(LAYOUT, TEXTS, focus_form="find")
    reasons = [state.feed(k, p) for k, p in enumerate(ECONOMY)]
    assert reasons[:-1] == [None] * (len(ECONOMY) - 1) and reasons[-1] == "answer"
    assert state.answer_open()


def test_chunk_texts_must_match_the_layout() -> None:
    with pytest.raises(ValueError, match="2 chunk texts for a layout of 3 chunks"):
        DAState(LAYOUT, TEXTS[:2])


def test_the_end_is_banned_until_an_answer_is_open() -> None:
    state = DAState(LAYOUT, TEXTS, focus_form="find", end_ids=(7, 9))
    assert state.banned_ids() == ()  # nothing declared yet: a plain reply may end
    for k, piece in enumerate(['<focus find="last train">', "eleven", "</focus>", "<ans"]):
        state.feed(k, piece)
        assert state.banned_ids() == ((7, 9) if k < 3 else ())  # '<ans' is opening it
    plain = DAState(LAYOUT, TEXTS, focus_form="find", end_ids=(7, 9))
    plain.feed(0, "The last train leaves at eleven.")
    assert plain.banned_ids() == ()  # it never declared: a plain answer, free to end
    assert DAState(LAYOUT, TEXTS).banned_ids() == ()  # no end ids: nothing banned


@pytest.mark.parametrize(
    ("written", "closed"),
    [
        ("last", '">'),  # whole word, one chunk: more words would read the same chunk
        ("the last train", '">'),
        ("the", None),  # in chunks 1 and 2: more words may still choose
        ("rye br", None),  # inside a word
        ("sell", None),  # "sells" goes on: not a whole word where it occurs
        ("parking is", '">'),
        ("", None),
    ],
)
def test_a_find_phrase_is_closed_once_it_names_one_chunk(written, closed) -> None:
    state = DAState(LAYOUT, TEXTS, focus_form="find", close_at_one_chunk=True)
    state.feed(0, f'<focus find="{written}')
    assert state.forced_text() == closed
    if closed is not None:  # the phrase the close leaves resolves to that one chunk
        state.feed(1, closed)
        assert state.mode is Mode.FOCUS and len(state.focus_ids) == 1
    off = DAState(LAYOUT, TEXTS, focus_form="find")
    off.feed(0, f'<focus find="{written}')
    assert off.forced_text() is None


def test_a_phrase_across_a_chunk_boundary_is_not_closed_early() -> None:
    state = DAState(LAYOUT, TEXTS, focus_form="find", close_at_one_chunk=True)
    state.feed(0, "<focus find='rye bread the")  # runs from chunk 1 into chunk 2
    assert state.forced_text() is None
    state.feed(1, " last")
    assert state.forced_text() is None  # still in both; only the model may close it
    single = DAState(LAYOUT, TEXTS, focus_form="find", close_at_one_chunk=True)
    single.feed(0, "<focus find='leeds")
    assert single.forced_text() == "'>"  # the quote the value opened with


def test_without_jump_forward_the_find_constraint_holds_the_close() -> None:
    vocab = FindVocab({1: '"', 2: '">', 3: " train", 4: " leeds", 5: ">", 6: "'>"})
    state = DAState(LAYOUT, TEXTS, focus_form="find", find_vocab=vocab, close_at_one_chunk=True)
    state.feed(0, '<focus find="the last')
    find = state.constraints[0]
    assert sorted(find.allowed_ids(state.reader.pending)) == [1, 2]  # '"' or '">', no more words
    loose = DAState(LAYOUT, TEXTS, focus_form="find", find_vocab=vocab)
    loose.feed(0, '<focus find="the last')
    assert 3 in loose.constraints[0].allowed_ids(loose.reader.pending)
