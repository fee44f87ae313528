"""The fewest tokens a text can be: never more than the tokenizer really writes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from declattn.server.token_bound import COMPOSE_FACTOR, fewest_tokens, max_chars_per_token

TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=300),
    # what packs many characters into one token: runs, and NFC-composable sequences
    st.builds(lambda piece, n: piece * n,
              st.sampled_from([" ", "=", "-", "\n", "a", "e\u0301", "\u1100\u1161\u11a8",
                               "A\u030a\u0301", "    return self", "ab"]),
              st.integers(1, 400)),
)


def _check(tokenizer: Any, text: str) -> None:
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    actual = len(tokenizer.encode(text, add_special_tokens=False))
    assert fewest_tokens(len(text), bound) <= actual, (text[:40], bound, actual)


def _byte_bpe(normalizer: Any | None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained here (no download), optionally with a normalizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the keeper lived on the island " * 50, "=" * 300, " " * 300, "Åǻ é 한국어 " * 40]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


NFC_BPE = _byte_bpe(normalizers.NFC())
PLAIN_BPE = _byte_bpe(None)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_the_bound_holds_for_smollm2(smol_engine: Any, text: str) -> None:
    _check(smol_engine.tokenizer, text)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_the_bound_holds_with_a_composing_normalizer(text: str) -> None:
    _check(NFC_BPE, text)
    _check(PLAIN_BPE, text)


def test_the_bound_values(smol_engine: Any) -> None:
    longest = max(len(t) for t in smol_engine.tokenizer.get_vocab())
    assert max_chars_per_token(smol_engine.tokenizer) == longest == 81
    plain = max_chars_per_token(PLAIN_BPE)
    assert max_chars_per_token(NFC_BPE) == COMPOSE_FACTOR * max(
        len(t) for t in NFC_BPE.get_vocab())
    assert plain == max(len(t) for t in PLAIN_BPE.get_vocab())


def test_no_bound_where_input_is_dropped() -> None:
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish: no bound holds
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=words)) is None
    assert max_chars_per_token(object()) is None  # not a fast tokenizer


@pytest.mark.parametrize(("chars", "bound", "least"), [(0, 5, 0), (1, 5, 1), (10, 5, 2),
                                                       (11, 5, 3), (100, None, 0)])
def test_fewest_tokens(chars: int, bound: int | None, least: int) -> None:
    assert fewest_tokens(chars, bound) == least
