"""Tests for the in-context index: names per chunk, within a token budget."""

from __future__ import annotations

import pytest

from declattn.protocol.index import chunk_index

TEXTS = [
    "The bakery on Mill Lane sells rye bread. The bakery opened in 1921.",
    "Our choir meets on Tuesdays in St Mary Hall. Maria Olsen sings.",
    "The last train to Leeds leaves at 11:40 pm. Maria Olsen takes it.",
    "Parking is free after six.",
]


def words(text: str) -> int:
    return len(text.split())


def test_one_line_per_chunk_with_what_sets_it_apart() -> None:
    lines = chunk_index(TEXTS, words, 60)
    assert lines == [
        "Chunk 1: Mill Lane, 1921",
        "Chunk 2: Tuesdays, St Mary Hall, Maria Olsen",  # in 2 chunks: after the rarer
        "Chunk 3: Leeds, 11:40, Maria Olsen",
        "Chunk 4:",
    ]


def test_sentence_starts_are_not_names() -> None:
    lines = chunk_index(TEXTS, words, 60)
    text = "\n".join(lines)
    for word in ("The", "Our", "Parking"):
        assert word not in text


def test_rarer_names_come_first_and_the_budget_holds() -> None:
    lines = chunk_index(TEXTS, words, 12)  # 3 words a line
    assert lines == ["Chunk 1: 1921", "Chunk 2: Tuesdays", "Chunk 3: Leeds", "Chunk 4:"]
    assert words("\n".join(lines)) <= 12
    for budget in range(8, 40):
        assert words("\n".join(chunk_index(TEXTS, words, budget))) <= budget


def test_a_name_in_every_chunk_is_not_distinctive() -> None:
    texts = ["Ada met Bob in Paris.", "Ada met Carl in Rome."]
    lines = chunk_index(texts, words, 20)
    assert lines == ["Chunk 1: Bob, Paris", "Chunk 2: Carl, Rome"]


def test_a_heading_leads_its_line() -> None:
    texts = ["# Harbour log\nThe harbour of Brack Island was busy.", "Nothing happened there."]
    assert chunk_index(texts, words, 20)[0] == "Chunk 1: Harbour log, Brack Island"


def test_counts_that_are_not_additive_are_still_bounded() -> None:
    def chars(text: str) -> int:  # a "tokenizer" whose joined count exceeds the line sum
        return len(text) // 4 + text.count("\n") * 3

    for budget in (17, 20, 30, 50):
        assert chars("\n".join(chunk_index(TEXTS, chars, budget))) <= budget


def test_a_budget_too_small_for_the_bare_lines_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs at least 8 tokens, budget 7"):
        chunk_index(TEXTS, words, 7)
    assert chunk_index([], words, 0) == []


def test_a_name_inside_a_chosen_one_is_not_repeated() -> None:
    texts = ["The Leeds Station is busy; in Leeds the trains run. Ask Lee or ask the guard.",
             "No."]
    assert chunk_index(texts, words, 30)[0] == "Chunk 1: Leeds Station, Lee"
