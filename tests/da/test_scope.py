"""Tests for Scope: kept spans, kept blocks and attended-token counts."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.da.scope import Scope, StepCount
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode


def make_layout() -> Layout:
    # sink [0,16), chunks [20,60) [60,100) [110,150), question [150,200)
    return Layout(
        prompt_len=200,
        sink=Span(0, 16),
        chunks=(Span(20, 60), Span(60, 100), Span(110, 150)),
        question=Span(150, 200),
    )


# -- brute-force reference ---------------------------------------------------------------


def kept_positions(scope: Scope, length: int) -> list[int]:
    lay = scope.layout
    out = []
    for p in range(length):
        always = (
            lay.sink.start <= p < lay.sink.end
            or lay.question.start <= p < lay.question.end
            or p >= lay.prompt_len
        )
        in_focus = any(lay.chunk(i).start <= p < lay.chunk(i).end for i in scope.focus_ids)
        if scope.mode is Mode.GLOBAL or always or (scope.mode is Mode.FOCUS and in_focus):
            out.append(p)
    return out


def spans_to_positions(spans: list[Span]) -> list[int]:
    return [p for s in spans for p in range(s.start, s.end)]


@st.composite
def scopes(draw: st.DrawFn) -> tuple[Scope, int, int]:
    prompt_len = draw(st.integers(1, 300))
    sink_end = draw(st.integers(0, min(16, prompt_len)))
    n_cuts = draw(st.integers(0, 8)) * 2
    cuts = sorted(draw(st.lists(st.integers(sink_end, prompt_len), min_size=n_cuts,
                                max_size=n_cuts)))
    chunks = tuple(Span(cuts[i], cuts[i + 1]) for i in range(0, n_cuts, 2))
    q_start = draw(st.integers(cuts[-1] if cuts else sink_end, prompt_len))
    layout = Layout(prompt_len, Span(0, sink_end), chunks, Span(q_start, prompt_len))
    modes = [Mode.GLOBAL, Mode.LOCAL, Mode.ANSWER] + ([Mode.FOCUS] if chunks else [])
    mode = draw(st.sampled_from(modes))
    ids: tuple[int, ...] = ()
    if mode is Mode.FOCUS:
        ids = tuple(draw(st.lists(st.integers(1, len(chunks)), min_size=1, max_size=3,
                                  unique=True)))
    length = draw(st.integers(1, prompt_len + 80))
    block_size = draw(st.sampled_from([1, 2, 3, 7, 16, 64]))
    return Scope(layout, mode, ids), length, block_size


@settings(max_examples=400, deadline=None)
@given(scopes())
def test_against_brute_force(case: tuple[Scope, int, int]) -> None:
    scope, length, bs = case
    positions = kept_positions(scope, length)
    spans = scope.kept_spans(length)
    # sorted, merged (no touching neighbours), non-empty, inside [0, length)
    assert all(s.start < s.end for s in spans)
    assert all(a.end < b.start for a, b in zip(spans, spans[1:], strict=False))
    assert all(0 <= s.start and s.end <= length for s in spans)
    assert spans_to_positions(spans) == positions

    blocks = scope.kept_blocks(length, bs)
    assert blocks == sorted({p // bs for p in positions} | {(length - 1) // bs})
    assert all(0 <= b < -(-length // bs) for b in blocks)
    assert scope.kept_block_ranges(length, bs) == [
        r for r in _runs(blocks)
    ]

    c = scope.count(length, bs)
    assert c == StepCount(
        logical=len(positions),
        physical=len(blocks) * bs,
        vanilla_logical=length,
        vanilla_physical=-(-length // bs) * bs,
    )
    assert c.logical <= c.physical <= c.vanilla_physical
    assert c.logical <= c.vanilla_logical


@settings(max_examples=300, deadline=None)
@given(scopes())
def test_kept_blocks_depend_on_length_only_through_the_newest_block(
    case: tuple[Scope, int, int],
) -> None:
    """What lets a session hand the engine one view for every step in a block
    (``Session._kept_blocks``)."""
    scope, length, bs = case
    newest = (length - 1) // bs
    blocks = scope.kept_blocks(length, bs)
    for other in range(newest * bs + 1, (newest + 1) * bs + 1):
        assert scope.kept_blocks(other, bs) == blocks


def _runs(blocks: list[int]) -> list[Span]:
    out: list[Span] = []
    for b in blocks:
        if out and out[-1].end == b:
            out[-1] = Span(out[-1].start, b + 1)
        else:
            out.append(Span(b, b + 1))
    return out


# -- hand-checked cases ------------------------------------------------------------------


def test_global_keeps_everything() -> None:
    s = Scope(make_layout())
    for length in (1, 17, 200, 213):
        assert s.kept_spans(length) == [Span(0, length)]
        assert s.kept_blocks(length) == list(range(-(-length // 16)))
        c = s.count(length)
        assert (c.logical, c.physical) == (c.vanilla_logical, c.vanilla_physical)


def test_local_keeps_sink_question_and_response() -> None:
    s = Scope(make_layout(), Mode.LOCAL)
    assert s.kept_spans(230) == [Span(0, 16), Span(150, 230)]
    # sink -> block 0; [150, 230) -> blocks 9..14 (150//16 = 9, 229//16 = 14)
    assert s.kept_blocks(230) == [0, 9, 10, 11, 12, 13, 14]
    assert s.count(230) == StepCount(16 + 80, 7 * 16, 230, 15 * 16)
    assert Scope(make_layout(), Mode.ANSWER).kept_spans(230) == s.kept_spans(230)


def test_focus_adds_its_chunks_and_rounds_outward() -> None:
    s = Scope(make_layout(), Mode.FOCUS, (3, 1))
    assert s.kept_spans(201) == [Span(0, 16), Span(20, 60), Span(110, 201)]
    # [20, 60) -> blocks 1..3 ; [110, 201) -> blocks 6..12
    assert s.kept_blocks(201) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12]
    assert s.count(201).logical == 16 + 40 + 91
    # Adjacent chunks merge into one span.
    assert Scope(make_layout(), Mode.FOCUS, (1, 2)).kept_spans(200) == [
        Span(0, 16), Span(20, 100), Span(150, 200)
    ]


def test_newest_token_block_is_always_kept() -> None:
    # A layout whose always-kept parts stop short of the newest position.
    lay = Layout(prompt_len=100, sink=Span(0, 4), chunks=(Span(10, 90),), question=Span(90, 100))
    s = Scope(lay, Mode.LOCAL)
    # length below the prompt: position 60 is in no kept span, yet its block is kept
    assert s.kept_spans(61) == [Span(0, 4)]
    assert s.kept_blocks(61, 16) == [0, 3]
    assert s.count(61, 16) == StepCount(4, 32, 61, 64)


def test_block_size_one_matches_logical() -> None:
    s = Scope(make_layout(), Mode.FOCUS, (2,))
    c = s.count(250, block_size=1)
    assert c.physical == c.logical == 16 + 40 + 100


def test_validation() -> None:
    lay = make_layout()
    with pytest.raises(ValueError, match="at least one"):
        Scope(lay, Mode.FOCUS)
    with pytest.raises(ValueError, match="not in the layout"):
        Scope(lay, Mode.FOCUS, (4,))
    with pytest.raises(ValueError, match="not in the layout"):
        Scope(lay, Mode.FOCUS, (0,))
    with pytest.raises(ValueError, match="duplicate"):
        Scope(lay, Mode.FOCUS, (1, 1))
    with pytest.raises(ValueError, match="only focus"):
        Scope(lay, Mode.LOCAL, (1,))
    with pytest.raises(ValueError):
        Scope(lay, "nonsense")  # type: ignore[arg-type]
    s = Scope(lay, "focus", [2])  # type: ignore[arg-type]
    assert s.mode is Mode.FOCUS and s.focus_ids == (2,)
    with pytest.raises(ValueError, match="length"):
        s.kept_spans(0)
    with pytest.raises(ValueError, match="block_size"):
        s.kept_blocks(10, 0)
    with pytest.raises(ValueError, match="length"):
        s.count(0)


def test_kept_blocks_is_fast_at_128k() -> None:
    """Once per decode step at 128K tokens (8K blocks): must be far below a step's time."""
    chunks = tuple(Span(64 + i * 2048, 64 + (i + 1) * 2048) for i in range(62))
    prompt_len = 64 + 62 * 2048 + 256
    lay = Layout(prompt_len, Span(0, 16), chunks, Span(64 + 62 * 2048, prompt_len))
    length = prompt_len + 1000
    for scope in (Scope(lay), Scope(lay, Mode.FOCUS, (1, 30, 62)), Scope(lay, Mode.LOCAL)):
        t0 = time.perf_counter()
        for _ in range(20):
            blocks = scope.kept_blocks(length)
            scope.count(length)
        per_call = (time.perf_counter() - t0) / 20
        assert per_call < 0.02, per_call  # measured ~0.1 ms for global, far less otherwise
    assert len(Scope(lay).kept_blocks(length)) == -(-length // 16) > 8000
    assert len(blocks) == 1 + (length - 1) // 16 - (64 + 62 * 2048) // 16 + 1  # sink + tail


def test_no_torch_import() -> None:
    """Scope, tags, accounting and replay are protocol-level: usable without torch."""
    import subprocess
    import sys

    code = (
        "import sys; import declattn.da.scope, declattn.protocol.tags, declattn.da.accounting, "
        "declattn.da.replay, declattn.protocol.find, declattn.protocol.index, "
        "declattn.protocol.instruction; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
