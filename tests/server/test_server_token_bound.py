"""The fewest tokens a text can be: never more than the tokenizer really writes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from declattn.server.token_bound import COMPOSE_FACTOR, TokenBound, token_bound

TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=300),
    # what packs many characters into one token: runs, and NFC-composable sequences
    st.builds(lambda piece, n: piece * n,
              st.sampled_from([" ", "=", "-", "\n", "a", "e\u0301", "\u1100\u1161\u11a8",
                               "A\u030a\u0301", "    return self", "ab"]),
              st.integers(1, 400)),
)


_BOUNDS: list[tuple[Any, TokenBound]] = []
"""Each tokenizer's bound, worked out once: ``token_bound`` reads the whole serialised
tokenizer (half a second for SmolLM2's), and the property is about the bound it gives,
which is the same for every text. Held with the tokenizer, so no other one shares it."""


def _bound(tokenizer: Any) -> TokenBound:
    for tok, bound in _BOUNDS:
        if tok is tokenizer:
            return bound
    found = token_bound(tokenizer)
    assert found is not None
    _BOUNDS.append((tokenizer, found))
    return found


def _check(tokenizer: Any, text: str) -> None:
    bound = _bound(tokenizer)
    actual = len(tokenizer.encode(text, add_special_tokens=False))
    assert bound.fewest_tokens(text) <= actual, (text[:40], bound.chars_per_token, actual)


CORPUS = ["the keeper lived on the island " * 50, "=" * 300, " " * 300, "Åǻ é 한국어 " * 40]


def _byte_bpe(normalizer: Any | None, alphabet: bool = True) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained here (no download), optionally with a normalizer;
    without the whole byte alphabet it has only the bytes of ``CORPUS``."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else []))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


NFC_BPE = _byte_bpe(normalizers.NFC())
PLAIN_BPE = _byte_bpe(None)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
@example(text="\x16")  # SmolLM2 writes no token for it (CI found it, 2026-12-03)
@example(text="a\x04\x06\x13\x14\x16\x1db" * 30)
def test_the_bound_holds_for_smollm2(smol_engine: Any, text: str) -> None:
    _check(smol_engine.tokenizer, text)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_the_bound_holds_with_a_composing_normalizer(text: str) -> None:
    _check(NFC_BPE, text)
    _check(PLAIN_BPE, text)


def test_the_bound_values(smol_engine: Any) -> None:
    longest = max(len(t) for t in smol_engine.tokenizer.get_vocab())
    bound = token_bound(smol_engine.tokenizer)
    assert bound is not None and bound.chars_per_token == longest == 81
    plain, nfc = token_bound(PLAIN_BPE), token_bound(NFC_BPE)
    assert plain is not None and nfc is not None
    assert nfc.chars_per_token == COMPOSE_FACTOR * max(len(t) for t in NFC_BPE.get_vocab())
    assert plain.chars_per_token == max(len(t) for t in PLAIN_BPE.get_vocab())
    assert plain.dropped == nfc.dropped == frozenset()


def test_the_characters_smollm2_drops_are_exactly_those_not_counted(smol_engine: Any) -> None:
    """Its byte-level vocabulary lacks six ASCII control bytes' symbols: BPE writes no
    token for those characters, and every other ASCII character gets one."""
    tok = smol_engine.tokenizer
    bound = token_bound(tok)
    assert bound is not None
    silent = {chr(b) for b in range(128) if not tok.encode(chr(b), add_special_tokens=False)}
    assert bound.dropped == silent and len(silent) == 6
    assert bound.kept("a\x16b\x16") == 2 and bound.fewest_tokens("\x16" * 500) == 0


def test_no_bound_where_longer_characters_can_vanish() -> None:
    """A byte-level vocabulary trained without the whole alphabet lacks the lead and the
    continuation bytes of characters it never saw: those vanish whole, so no bound."""
    partial = _byte_bpe(None, alphabet=False)
    assert partial.encode("\u0400", add_special_tokens=False) == []  # bytes D0 80
    assert token_bound(partial) is None


def test_no_bound_where_one_token_can_stand_for_a_whole_word() -> None:
    """WordPiece writes one [UNK] for a whole unknown word, however long."""
    wp = Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wp.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=wp)
    assert len(fast.encode("x" * 90, add_special_tokens=False)) == 1
    assert token_bound(fast) is None


def test_no_bound_where_input_is_dropped() -> None:
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish: no bound holds
    assert token_bound(PreTrainedTokenizerFast(tokenizer_object=words)) is None
    assert token_bound(object()) is None  # not a fast tokenizer


@pytest.mark.parametrize(("text", "per_token", "least"), [("", 5, 0), ("a", 5, 1),
                                                          ("a" * 10, 5, 2), ("a" * 11, 5, 3)])
def test_fewest_tokens(text: str, per_token: int, least: int) -> None:
    assert TokenBound(per_token).fewest_tokens(text) == least
    assert TokenBound(per_token, frozenset("a")).fewest_tokens(text) == 0
