"""Tests for the runaway guard: it stops loops and hopeless responses, and nothing else."""

from __future__ import annotations

import re
from typing import Any

import pytest

from declattn.da.runaway import NO_ANSWER, REPEAT, REPEAT_LINES, RunawayConfig, RunawayGuard


class WordTokens:
    """A stand-in tokenizer: words, single spaces, newlines and punctuation are tokens."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[tuple[int, str]]:
        pieces = re.findall(r"\w+|\s|[^\w\s]", text)
        return [(self.ids.setdefault(p, len(self.ids)), p) for p in pieces]


def run(text: str, guard: RunawayGuard | None = None, answer_open: bool = False) -> RunawayGuard:
    """Feed ``text`` token by token until the guard trips (or the text ends)."""
    guard = guard or RunawayGuard()
    for token_id, piece in WordTokens().encode(text):
        if guard.on_token(token_id, piece, answer_open):
            break
    return guard


def tokens_of(text: str) -> int:
    return len(WordTokens().encode(text))


# -- loops are stopped ---------------------------------------------------------------


def test_a_repeated_sentence_is_stopped_within_a_few_repeats() -> None:
    sentence = "The founding year should be in the company history, chunk four covers it. "
    period = tokens_of(sentence)
    assert 20 < period < 64
    guard = run("Let me think. " + sentence * 20)
    assert guard.reason == REPEAT
    assert guard.detail["period"] == period
    # stopped after the loop covered max(min_span, 2 periods) tokens, not at the end
    assert guard.n_tokens <= tokens_of("Let me think. ") + 3 * period


def test_a_single_token_loop_needs_min_span_tokens() -> None:
    config = RunawayConfig()
    guard = RunawayGuard(config)
    for i in range(config.min_span - 1):
        assert guard.on_token(7, "x", False) is None, i
    assert guard.on_token(7, "x", False) == REPEAT
    assert guard.detail == {"period": 1, "span": config.min_span}


def test_a_loop_late_in_a_long_response_is_caught_as_early() -> None:
    config = RunawayConfig()
    guard = RunawayGuard(config)
    for i in range(1000):
        assert guard.on_token(i, f"w{i} ", False) is None
    loop = [5001, 5002, 5003]
    fed = 0
    while guard.on_token(loop[fed % 3], "x", False) is None:
        fed += 1
    assert fed + 1 == config.min_span and guard.detail["period"] == 3


def test_a_short_line_repeated_is_stopped_by_the_line_rule() -> None:
    guard = run("<global>\nchunk 2\n\nchunk 2\nchunk 2\n  chunk 2\nchunk 2\nchunk 2\n" * 3)
    assert guard.reason == REPEAT_LINES
    assert guard.detail == {"line": "chunk 2", "count": 5}


def test_a_loop_of_tag_pairs_is_stopped() -> None:
    loop = '<focus magic_chunks="2">Maria kept it.</focus>\n<local>So Maria.</local>\n'
    guard = run(loop * 30)
    assert guard.reason in (REPEAT, REPEAT_LINES)
    assert guard.n_tokens < 4 * tokens_of(loop)


def test_no_answer_within_the_budget_stops_at_the_reserve() -> None:
    guard = RunawayGuard(max_tokens=200)
    reserve = guard.config.reserve(200)
    assert reserve == 32
    for i in range(200 - reserve - 1):
        assert guard.on_token(i, f"w{i} ", False) is None
    assert guard.on_token(10_000, "w ", False) == NO_ANSWER
    assert guard.n_tokens == 200 - reserve
    assert guard.to_dict()["reason"] == NO_ANSWER


def test_an_open_answer_or_no_budget_never_trips_the_no_answer_rule() -> None:
    with_answer = RunawayGuard(max_tokens=100)
    no_budget = RunawayGuard()
    for i in range(100):
        assert with_answer.on_token(i, f"w{i} ", True) is None
        assert no_budget.on_token(i, f"w{i} ", False) is None


def test_a_tiny_budget_keeps_a_quarter_for_the_answer() -> None:
    assert RunawayConfig().reserve(20) == 5
    assert RunawayConfig().reserve(3) == 0
    guard = RunawayGuard(max_tokens=3)
    assert [guard.on_token(i, "w", False) for i in range(3)] == [None, None, None]


def test_the_reason_sticks_once_tripped() -> None:
    guard = RunawayGuard(RunawayConfig(min_span=4, max_period=2))
    reasons = [guard.on_token(1, "a", False) for _ in range(6)]
    assert reasons == [None, None, None, REPEAT, REPEAT, REPEAT]


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        RunawayConfig(min_reps=1)
    with pytest.raises(ValueError):
        RunawayConfig(line_repeats=1)


# -- legitimate output is not stopped --------------------------------------------------

FRUIT = ["apple", "banana", "cherry", "damson", "elderberry", "fig", "grape", "huckleberry"]


def test_a_numbered_list_with_the_same_wording_is_not_stopped() -> None:
    text = "".join(f"{i}. The chunk mentions a date in the text.\n" for i in range(1, 60))
    assert run(text).reason is None


def test_a_list_of_similar_distinct_lines_is_not_stopped() -> None:
    text = "".join(
        f"- The {f} harvest of {1900 + i} was recorded in the ledger.\n"
        for i, f in enumerate(FRUIT * 6)
    )
    assert run(text).reason is None


def test_a_table_is_not_stopped() -> None:
    rows = "".join(f"| {f} | {i} | yes | no |\n" for i, f in enumerate(FRUIT * 5))
    text = "| fruit | count | ripe | sold |\n|---|---|---|---|\n" + rows
    assert run(text).reason is None


def test_prose_and_a_normal_da_response_are_not_stopped() -> None:
    text = (
        "<global>The keeper's name should be in the history; chunk 2 covers it.</global>\n"
        '<focus magic_chunks="2">Maria Olsen kept the light from 1920 to 1951</focus>\n'
        "<local>The question asks who kept the light, so it is Maria Olsen.</local>\n"
        "<answer>Maria Olsen</answer>"
    )
    guard = RunawayGuard(max_tokens=512)
    assert run(text, guard).reason is None
    assert run(" ".join(f"word{i}" for i in range(400))).reason is None


def test_repeated_words_and_blank_lines_are_not_a_loop() -> None:
    assert run("It was very very very very good.\n\n\n\nYes. Yes. Yes.\n").reason is None
    assert run("ok\nok\nok\nok\nfine\nok\n").reason is None  # four in a row, then broken


# -- wired through the DA session ------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer: Any) -> Any:
    """The real SmolLM2 tokenizer (byte-level BPE), shared with other test files."""
    return smol_tokenizer


CONTEXT = "Maria Olsen kept the light from 1920 to 1951.\n\nThe tower was automated in 1964.\n"


def feed(sess: Any, tokenizer: Any, text: str) -> tuple[str | None, int]:
    """Feed ``text`` token by token; return the first finish reason and tokens fed."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids, 1):
        reason = sess.on_token(i, tokenizer.decode([i]))
        if reason:
            return reason, n
    return None, len(ids)


def test_session_stops_a_loop(tokenizer: Any) -> None:
    from declattn.api.session import DASession
    from declattn.da.options import DAOptions

    sess = DASession(tokenizer, CONTEXT, "Who kept it?", DAOptions(target=24, cap=40))
    reason, n = feed(sess, tokenizer, "<global>I will look at chunk 1.\n" * 40)
    assert reason in (REPEAT, REPEAT_LINES) and n < 5 * 12
    assert sess.runaway is not None and sess.runaway.reason == reason
    off = DASession(tokenizer, CONTEXT, "Who kept it?", DAOptions(target=24, cap=40, runaway=False))
    assert off.runaway is None
    assert feed(off, tokenizer, "<global>I will look at chunk 1.\n" * 40)[0] is None


def test_session_stops_without_an_answer_but_not_with_one(tokenizer: Any) -> None:
    from declattn.api.session import DASession
    from declattn.da.options import DAOptions

    opts = DAOptions(target=24, cap=40)
    prose = " ".join(f"step{i}" for i in range(200))
    sess = DASession(tokenizer, CONTEXT, "Who kept it?", opts, max_tokens=100)
    reason, n = feed(sess, tokenizer, "<global>" + prose)
    assert reason == NO_ANSWER and n == 100 - 25
    answered = DASession(tokenizer, CONTEXT, "Who kept it?", opts, max_tokens=100)
    reason, n = feed(answered, tokenizer, "<answer>" + prose)
    assert reason is None
    closed = DASession(tokenizer, CONTEXT, "Who kept it?", opts, max_tokens=100)
    assert feed(closed, tokenizer, "<answer>Maria Olsen</answer> and more")[0] == "answer"
