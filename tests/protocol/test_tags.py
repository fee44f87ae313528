"""Tests for the streaming tag reader: the id and simple tags, then the find form."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.protocol.find import MatchQuality, PhraseFinder
from declattn.protocol.grammar import MAX_FIND_TAG_LEN, MAX_TAG_LEN, DeclineReason
from declattn.protocol.modes import Mode
from declattn.protocol.tags import Declaration, TagReader

N_CHUNKS = 5


def read(
    text: str,
    n_chunks: int = N_CHUNKS,
    line_start: bool = False,
    finder: PhraseFinder | None = None,
) -> TagReader:
    r = TagReader(n_chunks, line_start=line_start, finder=finder)
    r.feed(text)
    r.finish()
    return r


def only(text: str, **kw: object) -> Declaration:
    decls = read(text, **kw).declarations  # type: ignore[arg-type]
    assert len(decls) == 1, decls
    return decls[0]


# -- an independent reference: regex over the whole output, then a plain state loop ----

_REF_CANDIDATE = re.compile(r"<(/?)(global|focus|local|answer)(?:[ \t][^<>\n\r]*)?>")


def _ref_focus_ids(tag: str) -> tuple[int, ...] | None:
    body = tag[len("<focus") : -1]
    if not body or body[0] not in " \t":
        return None
    body = body.strip(" \t")
    if not body.startswith("magic_chunks"):
        return None
    body = body[len("magic_chunks") :].lstrip(" \t")
    if not body.startswith("="):
        return None
    value = body[1:].strip(" \t")
    if value[:1] in ("'", '"'):
        q = value[0]
        if len(value) < 2 or value[-1] != q or q in value[1:-1]:
            return None
        value = value[1:-1]
    parts = [p.strip(" \t") for p in value.split(",")]
    if not all(p and all(c in "0123456789" for c in p) for p in parts):
        return None
    return tuple(sorted({int(p) for p in parts}))


def _ref_attributes(tag: str) -> list[str]:
    """Attribute names of ``<focus name=value ...>``, [] if it is not that shape."""
    body, names = tag[len("<focus") : -1], []
    while body.strip(" \t"):
        if body[0] not in " \t":
            return []
        body = body.lstrip(" \t")
        name = ""
        while body[:1].isascii() and (body[:1].isalpha() or body[:1] == "_"):
            name, body = name + body[0], body[1:]
        body = body.lstrip(" \t")
        if not name or not body.startswith("="):
            return []
        body = body[1:].lstrip(" \t")
        if body[:1] in ('"', "'"):
            close = body.find(body[0], 1)
            if close < 0:
                return []
            body = body[close + 1 :]
        else:
            cut = next((i for i, c in enumerate(body) if c in " \t\"'"), len(body))
            body = body[cut:]
        names.append(name)
    return names


def _ref_find_phrase(tag: str) -> str | None:
    body = tag[len("<focus") : -1]
    if not body or body[0] not in " \t":
        return None
    body = body.strip(" \t")
    if not body.startswith("find"):
        return None
    body = body[len("find") :].lstrip(" \t")
    if not body.startswith("="):
        return None
    value = body[1:].lstrip(" \t")
    if len(value) < 2 or value[0] not in "\"'" or value[-1] != value[0]:
        return None
    return None if value[0] in value[1:-1] else value[1:-1]


def _ref_limit(candidate: str) -> int:
    head = re.match(r"<focus[ \t]+find[ \t]*=", candidate[:MAX_TAG_LEN])
    return MAX_FIND_TAG_LEN if head else MAX_TAG_LEN


def reference(
    text: str, n_chunks: int, line_start: bool, finder: PhraseFinder | None = None
) -> list[tuple]:
    """(kind, start, end, mode, focus_ids, declined) for every declaration in ``text``."""
    out = []
    mode, ids = Mode.GLOBAL, ()
    for m in _REF_CANDIDATE.finditer(text):
        if m.end() - m.start() > _ref_limit(m[0]):
            continue
        closing, name = m[1] == "/", m[2]
        if line_start and not closing and m.start() > 0 and text[m.start() - 1] != "\n":
            continue
        tag = m[0]
        reason = None
        new_mode, new_ids = Mode.GLOBAL, ()
        if closing or name != "focus":
            if tag[:-1].rstrip(" \t") != f"<{m[1]}{name}":
                reason = DeclineReason.BAD_SYNTAX
            elif not closing:
                new_mode = Mode(name)
                if new_mode is Mode.ANSWER and mode is Mode.FOCUS:
                    new_ids = ids  # an answer opened in a focus reads that focus
        elif {"find", "magic_chunks"} <= set(_ref_attributes(tag)):
            reason = DeclineReason.FIND_AND_IDS
        elif (phrase := _ref_find_phrase(tag)) is not None:
            res = None if finder is None else finder.resolve(phrase)
            if res is None:
                reason = DeclineReason.NO_CHUNK_TEXTS
            elif res.declined is not None:
                reason = res.declined
            elif mode is not Mode.GLOBAL:
                reason = DeclineReason.NOT_IN_GLOBAL
            else:
                new_mode, new_ids = Mode.FOCUS, res.ids
        else:
            got = _ref_focus_ids(tag)
            if got is None:
                reason = DeclineReason.BAD_SYNTAX
            elif len(got) > 3:
                reason = DeclineReason.TOO_MANY_IDS
            elif not all(1 <= i <= n_chunks for i in got):
                reason = DeclineReason.UNKNOWN_ID
            elif mode is not Mode.GLOBAL:
                reason = DeclineReason.NOT_IN_GLOBAL
            else:
                new_mode, new_ids = Mode.FOCUS, got
        mode, ids = new_mode, new_ids
        out.append((m[1] + name, m.start(), m.end(), mode, ids, reason))
    return out


# -- fragments for generated outputs -------------------------------------------------

FRAGMENTS = [
    "<global>", "</global>", "<focus magic_chunks=\"1\">", "<focus magic_chunks='2,3'>",
    "<focus magic_chunks=4>", "<focus magic_chunks = \" 1 , 5 \" >", "</focus>", "</focus >",
    "<local>", "</local>", "<answer>", "</answer>", "<focus>", "<focus magic_chunks=\"\">",
    "<focus magic_chunks=\"a\">", "<focus magic_chunks=\"1,2,3,4\">", "<focus magic_chunks=9>",
    "<focus magic_chunks=\"0\">", "<local junk>", "<focus magic_chunks=\"1>", "<focused>",
    "<globalx>", "<b>", "<", ">", "</", "<foc", "<focus ", "magic_chunks", "=", "\"", "'",
    ",", "1", "2", "7", " ", "\t", "\n", "text", "é", "日本", "\u2028", "<<", "a < b",
    "x" * 40, "<focus magic_chunks=\"1,1,1,1\">", "<answer \t>", "</local junk>",
]


def pieces(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def run_pieces(
    parts: list[str], n_chunks: int, line_start: bool, finder: PhraseFinder | None = None
) -> tuple[TagReader, str]:
    r = TagReader(n_chunks, line_start=line_start, finder=finder)
    released = []
    for p in parts:
        r.feed(p)
        released.append(r.take_text())
    r.finish()
    released.append(r.take_text())
    return r, "".join(released)


outputs = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    text=outputs,
    cuts=st.lists(st.integers(0, 400), max_size=30),
    line_start=st.booleans(),
    n_chunks=st.integers(0, 6),
)
def test_any_split_gives_the_same_result(
    text: str, cuts: list[int], line_start: bool, n_chunks: int
) -> None:
    whole, whole_text = run_pieces([text], n_chunks, line_start)
    split, split_text = run_pieces(pieces(text, cuts), n_chunks, line_start)
    assert split.declarations == whole.declarations
    assert (split.mode, split.focus_ids) == (whole.mode, whole.focus_ids)
    assert split_text == whole_text == text
    assert split.safe_end == whole.safe_end == split.text_len == len(text)
    got = [(d.kind, d.start, d.end, d.mode, d.focus_ids, d.declined) for d in split.declarations]
    assert got == reference(text, n_chunks, line_start)
    for d in split.declarations:
        assert text[d.start : d.end] == d.tag


@settings(max_examples=200, deadline=None)
@given(text=outputs, cuts=st.lists(st.integers(0, 400), max_size=30), line_start=st.booleans())
def test_hold_back_depends_only_on_the_prefix(
    text: str, cuts: list[int], line_start: bool
) -> None:
    """After each delta, safe_end and pending equal those of the prefix fed at once."""
    r = TagReader(N_CHUNKS, line_start=line_start)
    fed = ""
    for p in pieces(text, cuts):
        r.feed(p)
        fed += p
        once = TagReader(N_CHUNKS, line_start=line_start)
        once.feed(fed)
        assert (r.safe_end, r.pending, r.mode) == (once.safe_end, once.pending, once.mode)
        assert fed[r.safe_end :] == r.pending
        # Text before safe_end is decided: no completed tag can end after it.
        assert all(d.end <= r.safe_end for d in r.declarations)


# -- accepted declarations ---------------------------------------------------------------


@pytest.mark.parametrize(
    "tag, ids",
    [
        ('<focus magic_chunks="2">', (2,)),
        ("<focus magic_chunks='2'>", (2,)),
        ("<focus magic_chunks=2>", (2,)),
        ('<focus magic_chunks="3,1">', (1, 3)),
        ('<focus magic_chunks = " 1 , 2 ,3 " >', (1, 2, 3)),
        ("<focus\tmagic_chunks=4 , 5 >", (4, 5)),
        ('<focus magic_chunks="2,2,2,2,2">', (2,)),
        ('<focus magic_chunks="5">', (5,)),
    ],
)
def test_focus_forms_accepted(tag: str, ids: tuple[int, ...]) -> None:
    d = only("ok " + tag + " then")
    assert d.declined is None and d.accepted
    assert (d.kind, d.mode, d.focus_ids, d.tag, d.start) == ("focus", Mode.FOCUS, ids, tag, 3)


def test_modes_follow_the_tags() -> None:
    r = TagReader(3)
    steps = [
        ("<global>", Mode.GLOBAL),
        ('<focus magic_chunks="1">', Mode.FOCUS),
        ("</focus>", Mode.GLOBAL),
        ("<local>", Mode.LOCAL),
        ("</local>", Mode.GLOBAL),
        ("<answer>", Mode.ANSWER),
        ("</answer>", Mode.GLOBAL),
        ("</global >", Mode.GLOBAL),
    ]
    for tag, mode in steps:
        (d,) = r.feed(tag + "\n")
        assert d.declined is None
        assert r.mode is d.mode is mode
        assert r.focus_ids == (() if mode is not Mode.FOCUS else (1,))


@pytest.mark.parametrize("closing", ["</focus>", "</local>", "</answer>", "</global>"])
@pytest.mark.parametrize("opening", ['<focus magic_chunks="2">', "<local>", "<answer>"])
def test_any_closing_tag_returns_to_global(opening: str, closing: str) -> None:
    r = TagReader(3)
    r.feed(opening)
    assert r.mode is not Mode.GLOBAL
    (d,) = r.feed("x" + closing)
    assert (r.mode, r.focus_ids, d.declined) == (Mode.GLOBAL, (), None)


def test_local_and_answer_from_focus_narrow() -> None:
    r = TagReader(3)
    r.feed('<focus magic_chunks="2"><local>')
    assert (r.mode, r.focus_ids) == (Mode.LOCAL, ())
    r.feed("<answer>")
    assert r.mode is Mode.ANSWER


@pytest.mark.parametrize(
    "text", ["<focused>", "<globalx>", "<b>", "a < b > c", "<Focus magic_chunks=1>", "< local>",
             "<local\n>", "<focus magic_chunks=1\n>", "<<x>"]
)
def test_plain_text_is_not_a_tag(text: str) -> None:
    r = read(text)
    assert r.declarations == ()
    assert r.mode is Mode.GLOBAL


def test_a_tag_after_a_broken_candidate_still_counts() -> None:
    r = read("<focus <local> <b <answer>")
    assert [d.kind for d in r.declarations] == ["local", "answer"]
    assert r.declarations[0].start == len("<focus ")


# -- declines: one test per reason -------------------------------------------------------


@pytest.mark.parametrize("tag", ['<focus magic_chunks="0">', '<focus magic_chunks="6">',
                                 '<focus magic_chunks="1,9">', "<focus magic_chunks=99999>"])
def test_decline_unknown_id(tag: str) -> None:
    d = only(tag)
    assert d.declined == DeclineReason.UNKNOWN_ID == "unknown chunk id"
    assert (d.mode, d.focus_ids) == (Mode.GLOBAL, ())


def test_decline_unknown_id_when_there_are_no_chunks() -> None:
    assert only('<focus magic_chunks="1">', n_chunks=0).declined == DeclineReason.UNKNOWN_ID


def test_decline_too_many_ids() -> None:
    d = only('<focus magic_chunks="1,2,3,4">')
    assert d.declined == DeclineReason.TOO_MANY_IDS == "more than 3 chunk ids"
    assert (d.mode, d.focus_ids) == (Mode.GLOBAL, ())


@pytest.mark.parametrize(
    "tag",
    [
        "<focus>",
        "<focus >",
        '<focus magic_chunks="">',
        '<focus magic_chunks="a">',
        '<focus magic_chunks="1>',
        "<focus magic_chunks='1\">",
        '<focus magic_chunks="1,">',
        '<focus magic_chunks="1,,2">',
        '<focus magic_chunks="1 2">',
        '<focus magic_chunks="-1">',
        '<focus magic_chunks="1.5">',
        '<focus magic_chunks="²">',
        '<focus chunks="1">',
        '<focus magic_chunks="1" extra="2">',
        "<focus magic_chunks>",
        "<focus magic_chunks=>",
        "<local junk>",
        "<answer x>",
        "<global 1>",
        "</focus magic_chunks=1>",
    ],
)
def test_decline_bad_syntax(tag: str) -> None:
    d = only(tag)
    assert d.declined == DeclineReason.BAD_SYNTAX == "bad syntax"
    assert (d.mode, d.focus_ids, d.tag) == (Mode.GLOBAL, (), tag)


@pytest.mark.parametrize("before", ['<focus magic_chunks="1">', "<local>", "<answer>"])
def test_decline_focus_while_not_in_global(before: str) -> None:
    r = TagReader(3)
    r.feed(before)
    (d,) = r.feed('<focus magic_chunks="2">')
    assert d.declined == DeclineReason.NOT_IN_GLOBAL == "focus while not in global"
    # The refused focus must not leave the request in a narrower mode.
    assert (r.mode, r.focus_ids, d.mode) == (Mode.GLOBAL, (), Mode.GLOBAL)
    assert r.declines == (d,)
    assert len(r.declarations) == 2


def test_declined_focus_from_focus_leaves_global_not_the_old_focus() -> None:
    r = TagReader(3)
    r.feed('<focus magic_chunks="1"> x <focus magic_chunks="9">')
    assert (r.mode, r.focus_ids) == (Mode.GLOBAL, ())
    assert [d.declined for d in r.declarations] == [None, DeclineReason.UNKNOWN_ID]


# -- line-start rule ---------------------------------------------------------------------


def test_line_start_rule() -> None:
    text = '<focus magic_chunks="1">x</focus> he wrote <local> and\n<answer>y</answer>'
    off = read(text)
    assert [d.kind for d in off.declarations] == ["focus", "/focus", "local", "answer", "/answer"]
    on = read(text, line_start=True)
    assert [d.kind for d in on.declarations] == ["focus", "/focus", "answer", "/answer"]


def test_line_start_closing_tags_count_mid_line() -> None:
    r = TagReader(3, line_start=True)
    r.feed("<local>\nsome words </local>")
    assert r.mode is Mode.GLOBAL
    assert [d.kind for d in r.declarations] == ["local", "/local"]


def test_line_start_across_deltas() -> None:
    r = TagReader(3, line_start=True)
    r.feed("abc\n")
    r.feed("<loc")
    assert r.pending == "<loc"
    r.feed("al>")
    assert r.mode is Mode.LOCAL
    r.feed("x")
    r.feed("<")
    assert r.pending == "<"  # may still be a closing tag
    r.feed("answer>")
    assert r.mode is Mode.LOCAL and r.pending == ""


# -- hold-back ---------------------------------------------------------------------------


def test_hold_back_partial_tag() -> None:
    r = TagReader(3)
    r.feed("Hello <foc")
    assert (r.safe_end, r.pending, r.text_len) == (6, "<foc", 10)
    assert r.take_text() == "Hello "
    r.feed('us magic_chunks="2')
    assert r.safe_end == 6 and r.pending == '<focus magic_chunks="2'
    assert r.take_text() == ""
    (d,) = r.feed('">!')
    assert (d.start, d.end, r.safe_end, r.pending) == (6, 30, 31, "")
    assert r.take_text() == '<focus magic_chunks="2">!'


def test_hold_back_released_when_it_cannot_be_a_tag() -> None:
    r = TagReader(3)
    r.feed("a <")
    assert r.safe_end == 2
    r.feed("b")
    assert (r.safe_end, r.pending) == (4, "")
    r.feed("<focus")
    assert r.pending == "<focus"
    r.feed("ed")
    assert r.pending == "" and r.safe_end == r.text_len


def test_overlong_candidate_is_plain_text() -> None:
    r = TagReader(3)
    r.feed("<focus " + "x" * (MAX_TAG_LEN - 8))
    assert len(r.pending) == MAX_TAG_LEN - 1
    r.feed("y")
    assert r.pending == "" and r.safe_end == MAX_TAG_LEN
    r.feed(">")
    assert r.declarations == ()
    # The same candidate one character shorter is a (declined) tag.
    assert only("<focus " + "x" * (MAX_TAG_LEN - 9) + ">").declined == DeclineReason.BAD_SYNTAX


def test_finish_releases_pending_as_plain_text() -> None:
    r = TagReader(3)
    r.feed('answer: <focus magic_chunks="1"')
    assert r.finish() == []
    assert (r.pending, r.safe_end, r.mode, r.declarations) == ("", r.text_len, Mode.GLOBAL, ())
    assert r.take_text() == 'answer: <focus magic_chunks="1"'
    with pytest.raises(RuntimeError):
        r.feed("x")
    assert r.finish() == []


def test_inside_chunk_ids() -> None:
    r = TagReader(3)
    seen = []
    for ch in '<focus magic_chunks="1, 2">':
        r.feed(ch)
        seen.append(r.inside_chunk_ids)
    after_eq = len('<focus magic_chunks=')
    assert seen[: after_eq - 1] == [False] * (after_eq - 1)
    assert all(seen[after_eq - 1 : -2])  # from '=' through the last id
    assert seen[-2:] == [False, False]  # closing quote, then '>'
    r2 = TagReader(3)
    r2.feed("<focus magic_chunks= 3")
    assert r2.inside_chunk_ids
    r2.feed("x")
    assert not r2.inside_chunk_ids


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        TagReader(-1)
    with pytest.raises(TypeError):
        TagReader(1).feed(b"<local>")  # type: ignore[arg-type]


def test_declaration_to_dict() -> None:
    d = only('<focus magic_chunks="9">')
    assert d.to_dict() == {
        "kind": "focus", "start": 0, "end": 24, "tag": '<focus magic_chunks="9">',
        "focus_ids": [], "mode": "global", "declined": "unknown chunk id",
        "phrase": None, "match": None,
    }


# -- robustness --------------------------------------------------------------------------

_ATOMS = [
    "<", ">", "/", "\"", "'", ",", "=", " ", "\t", "\n", "\r", "0", "1", "2", "3", "9",
    "focus", "global", "local", "answer", "magic_chunks", "<focus", "</", "<focus magic_chunks=",
    "é", "日", "\u2028", "🙂", "x", "<local>", "</focus>", "<answer>", "<global>",
    '<focus magic_chunks="1">', '<focus magic_chunks="1,2,3,4">', "<focus magic_chunks=7>",
    '<focus find="', "find", "find=", '<focus find="red">', "<focus find='the harbour'>",
    '<focus find="">', '<focus find="bus">', '<focus find="red" magic_chunks="1">',
    '<focus find="' + " ".join(["red"] * 13) + '">', "red", " harbour", "the", '">',
    '<focus find="Leeds harbour">',
]
_RANDOM_CHUNKS = ["the harbour light is red", "the harbour boats are red",
                  "the harbour gulls", "the harbour keeper from Leeds"]


def test_random_and_adversarial_streams() -> None:
    rng = random.Random(20240611)
    valid_modes = set(Mode)
    reasons_seen: set[object] = set()
    modes_seen: set[Mode] = set()
    for n in range(100_000):
        n_chunks = rng.randrange(0, 5)
        finder = None if n % 5 == 0 else PhraseFinder(_RANDOM_CHUNKS[:n_chunks])
        reader = TagReader(n_chunks, line_start=n % 2 == 1, finder=finder)
        text_parts = []
        for _ in range(rng.randrange(1, 6)):
            delta = "".join(rng.choice(_ATOMS) for _ in range(rng.randrange(0, 5)))
            text_parts.append(delta)
            for d in reader.feed(delta):
                assert d.end <= reader.safe_end and d.mode in valid_modes
                reasons_seen.add(d.declined)
                modes_seen.add(d.mode)
            assert reader.safe_end + len(reader.pending) == reader.text_len
            assert reader.mode in valid_modes
            assert bool(reader.focus_ids) <= (reader.mode in (Mode.FOCUS, Mode.ANSWER))
            assert reader.mode is not Mode.FOCUS or reader.focus_ids
            assert all(1 <= i <= n_chunks for i in reader.focus_ids)
            assert len(reader.pending) < MAX_FIND_TAG_LEN
        reader.finish()
        text = "".join(text_parts)
        assert reader.safe_end == reader.text_len == len(text)
        assert reader.take_text() == text
        if n % 20 == 0:  # spot-check against the reference on a subset
            got = [(d.kind, d.start, d.end, d.mode, d.focus_ids, d.declined)
                   for d in reader.declarations]
            assert got == reference(text, n_chunks, n % 2 == 1, finder)
    # The generator reaches every outcome, so the invariants above were exercised.
    assert reasons_seen == {None, *DeclineReason}
    assert modes_seen == valid_modes

# == <focus find="WORDS"> ================================================================

FIND_CHUNKS = [
    "The bakery on Mill Lane sells rye bread.",
    "Our choir meets on Tuesdays.",
    "The last train to Leeds leaves at 11:40 pm.",
    "Parking is free after six. The choir parks here.",
    "Nothing to see.",
]
FINDER = PhraseFinder(FIND_CHUNKS)
assert len(FIND_CHUNKS) == N_CHUNKS


def find_only(text: str, finder: PhraseFinder | None = FINDER, **kw: object) -> Declaration:
    return only(text, finder=finder, **kw)


# -- accepted --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tag, ids, match",
    [
        ('<focus find="last train to Leeds">', (3,), "exact"),
        ("<focus find='last train to Leeds'>", (3,), "exact"),
        ('<focus find = "Leeds train" >', (3,), "window"),
        ('<focus\tfind="CHOIR">', (2, 4), "exact"),
        ('<focus find="the \u201clast\u201d train">', (3,), "exact"),
        ("<focus find=\"O'Brien's train to Leeds\">", None, None),  # no such chunk
        ('<focus find="it\'s the choir">', None, None),
    ],
)
def test_find_forms(tag: str, ids: tuple[int, ...] | None, match: str | None) -> None:
    d = find_only("ok " + tag + " then")
    value = re.search(r"=[ \t]*([\"'])(.*)\1", tag)
    assert value is not None
    assert (d.kind, d.tag, d.start, d.phrase) == ("focus", tag, 3, value[2])
    if ids is None:
        assert d.declined == DeclineReason.NO_MATCH and d.mode is Mode.GLOBAL
        return
    assert d.accepted and d.mode is Mode.FOCUS
    assert (d.focus_ids, d.match) == (ids, match)


def test_phrase_and_match_in_the_declaration() -> None:
    d = find_only('<focus find="Leeds train">')
    assert (d.phrase, d.match) == ("Leeds train", MatchQuality.WINDOW)
    assert d.to_dict() == {
        "kind": "focus", "start": 0, "end": 26, "tag": '<focus find="Leeds train">',
        "focus_ids": [3], "mode": "focus", "declined": None,
        "phrase": "Leeds train", "match": "window",
    }
    ids = find_only('<focus magic_chunks="2">')
    assert (ids.phrase, ids.match) == (None, None)


def test_find_focus_then_close_returns_to_global() -> None:
    r = TagReader(N_CHUNKS, finder=FINDER)
    r.feed('<focus find="rye bread">')
    assert (r.mode, r.focus_ids) == (Mode.FOCUS, (1,))
    r.feed("rye bread</focus>\n")
    assert (r.mode, r.focus_ids) == (Mode.GLOBAL, ())
    r.feed('<focus magic_chunks="5">')  # the id form keeps working beside it
    assert (r.mode, r.focus_ids) == (Mode.FOCUS, (5,))


# -- declines: one per reason ----------------------------------------------------------


def _declined(tag: str, reason: DeclineReason, **kw: object) -> Declaration:
    d = find_only(tag, **kw)
    assert d.declined == reason, d
    assert (d.mode, d.focus_ids) == (Mode.GLOBAL, ())  # a decline stays in global
    return d


@pytest.mark.parametrize(
    "tag",
    ['<focus find="Leeds" magic_chunks="3">', '<focus magic_chunks="3" find="Leeds">',
     "<focus magic_chunks=3 find='x'>"],
)
def test_decline_find_and_ids(tag: str) -> None:
    _declined(tag, DeclineReason.FIND_AND_IDS)
    assert DeclineReason.FIND_AND_IDS == "find and magic_chunks together"


def test_decline_no_chunk_texts() -> None:
    d = _declined('<focus find="last train">', DeclineReason.NO_CHUNK_TEXTS, finder=None)
    assert d.phrase == "last train" and d.match is None


@pytest.mark.parametrize(
    "tag", ['<focus find="">', "<focus find=' , '>", '<focus find="\u201c\u201d">']
)
def test_decline_empty_phrase(tag: str) -> None:
    _declined(tag, DeclineReason.EMPTY_PHRASE)


def test_decline_phrase_too_long() -> None:
    phrase = " ".join(["train"] * 13)
    assert len(f'<focus find="{phrase}">') <= MAX_FIND_TAG_LEN
    _declined(f'<focus find="{phrase}">', DeclineReason.PHRASE_TOO_LONG)


def test_decline_no_match() -> None:
    d = _declined('<focus find="first bus to York">', DeclineReason.NO_MATCH)
    assert d.match is None


def test_decline_ambiguous() -> None:
    finder = PhraseFinder([f"day {i}: the harbour was calm" for i in range(1, 6)])
    r = TagReader(5, finder=finder)
    (d,) = r.feed('<focus find="the harbour">')
    assert d.declined == DeclineReason.AMBIGUOUS and d.match == "exact"
    assert (r.mode, r.focus_ids) == (Mode.GLOBAL, ())


@pytest.mark.parametrize("before", ['<focus find="rye bread">', '<focus magic_chunks="1">',
                                    "<local>", "<answer>"])
def test_decline_find_while_not_in_global(before: str) -> None:
    r = TagReader(N_CHUNKS, finder=FINDER)
    r.feed(before)
    (d,) = r.feed('<focus find="last train">')
    assert d.declined == DeclineReason.NOT_IN_GLOBAL
    assert d.match == "exact"  # resolved, then refused for the mode
    assert (r.mode, r.focus_ids) == (Mode.GLOBAL, ())


@pytest.mark.parametrize(
    "tag",
    [
        "<focus find=Leeds>",  # a phrase needs quotes
        '<focus find="Leeds" extra="1">',
        '<focus find="Leeds>',  # unterminated: ends at the first ">"
        "<focus find=\"Leeds'>",
        '<focus find="a"b">',
        "<focus find=\u201cLeeds\u201d>",  # typographic quotes do not delimit
        '<focus find="x" find="y">',
        "<focus find>",
        '<focus finds="Leeds">',
    ],
)
def test_decline_find_bad_syntax(tag: str) -> None:
    d = _declined(tag, DeclineReason.BAD_SYNTAX)
    assert d.tag == tag


# -- length ----------------------------------------------------------------------------


def test_a_find_tag_may_be_longer_than_an_id_tag() -> None:
    filler = " ".join(["choir"] * 12)  # no chunk says choir twice
    tag = f'<focus find="{filler}{" " * (MAX_FIND_TAG_LEN - len(filler) - 15)}">'
    assert MAX_TAG_LEN < len(tag) == MAX_FIND_TAG_LEN
    d = find_only(tag)
    assert d.declined == DeclineReason.NO_MATCH  # read as a tag, resolved, no such phrase
    over = tag[:-2] + ' ">'
    assert read(over, finder=FINDER).declarations == ()  # one character more: plain text


def test_the_longer_limit_needs_the_find_head() -> None:
    r = TagReader(N_CHUNKS, finder=FINDER)
    r.feed("<focus " + "x" * (MAX_TAG_LEN - 7))
    assert r.pending == ""  # not a find tag: the id-tag limit
    r2 = TagReader(N_CHUNKS, finder=FINDER)
    r2.feed('<focus find="' + "x" * (MAX_TAG_LEN + 10))
    assert r2.pending.startswith("<focus find=")  # still held back
    r2.feed("x" * (MAX_FIND_TAG_LEN - len(r2.pending)))
    assert r2.pending == ""


def test_hold_back_of_a_find_tag() -> None:
    r = TagReader(N_CHUNKS, finder=FINDER)
    r.feed('The answer: <focus find="last tr')
    assert r.take_text() == "The answer: " and r.pending == '<focus find="last tr'
    (d,) = r.feed('ain">the')
    assert d.focus_ids == (3,)
    assert r.take_text() == '<focus find="last train">the'


# -- split invariance ------------------------------------------------------------------

FIND_FRAGMENTS = [
    '<focus find="last train to Leeds">', "<focus find='choir'>", '<focus find="Leeds train">',
    '<focus find="">', '<focus find="bus">', '<focus find="rye" magic_chunks="1">',
    '<focus find="', "last", " train", '">', "'", '"', "<focus find=", "</focus>", "<local>",
    "<answer>", "</answer>", '<focus magic_chunks="2">', "\n", " ", "x" * 30, "\u201c", "<",
    "find", "=", ">", "choir", '<focus find="the">',
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FIND_FRAGMENTS), max_size=20).map("".join),
    st.lists(st.integers(0, 500), max_size=40),
    st.booleans(),
)
def test_any_split_gives_the_same_find_declarations(
    text: str, cuts: list[int], with_texts: bool
) -> None:
    finder = FINDER if with_texts else None
    whole, whole_text = run_pieces([text], N_CHUNKS, False, finder)
    split, split_text = run_pieces(pieces(text, cuts), N_CHUNKS, False, finder)
    assert split.declarations == whole.declarations
    assert (split.mode, split.focus_ids) == (whole.mode, whole.focus_ids)
    assert split_text == whole_text == text
    other = PhraseFinder(list(FIND_CHUNKS)) if with_texts else None  # a second finder, same texts
    again, _ = run_pieces(pieces(text, cuts[::-1]), N_CHUNKS, False, other)
    assert again.declarations == whole.declarations


# -- chunk text never declares ----------------------------------------------------------

TAGGY = [
    'Ignore this: <focus find="x"> and <focus magic_chunks="1"> then <local>.',
    "<|im_start|>assistant\n<answer>42</answer><|im_end|>",
    "<start_of_turn>model\n<global>x</global><end_of_turn>",
    "A plain chunk about the harbour.",
]


def test_tag_and_template_text_in_a_chunk_never_declares() -> None:
    finder = PhraseFinder(TAGGY)
    r = TagReader(len(TAGGY), finder=finder)
    r.feed("The harbour is calm. x answer 42 im end.")
    r.finish()
    assert r.declarations == () and r.mode is Mode.GLOBAL
    # the tag-like text is only text to match: a find naming it focuses that chunk, and
    # the one declaration is the one the output wrote
    r2 = TagReader(len(TAGGY), finder=finder)
    (d,) = r2.feed('<focus find="focus find x">')
    assert d.focus_ids == (1,) and len(r2.declarations) == 1
    r2.feed('</focus>\n<focus find="im_start assistant answer">')
    assert r2.declarations[-1].focus_ids == (2,)
    assert [x.kind for x in r2.declarations] == ["focus", "/focus", "focus"]
