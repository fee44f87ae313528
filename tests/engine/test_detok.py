"""The incremental detokenizer: its pieces add up to the tokenizer's own decode, and a
step does not decode the whole response again."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from declattn.engine.detok import Detokenizer

TEXTS = [
    "Hello, world! The answer is 42.\n\nNext line:  two spaces, a tab\tthen more.",
    "Café crème, naïve façade; 中文字符 and 🙂🚀 emoji split over byte tokens.",
    "<focus magic_chunks=\"3\">short</focus> then text",
]


def _byte_fallback() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (``▁`` for spaces, bytes for unknown characters,
    as Gemma's and Llama's): only a few characters are tokens, the rest are bytes."""
    vocab = {"<unk>": 0, "<eos>": 1}
    vocab.update({f"<0x{b:02X}>": 2 + b for b in range(256)})
    for piece in "▁abcdefghijklmnopqrstuvwxyzHTN,.!:;'\"<>=/0123456789":
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _pieces(tok, ids: list[int]) -> tuple[list[str], str]:
    d = Detokenizer(tok)
    parts = [d.add(i) for i in ids]
    return parts, d.flush()


def _ids(tok, text: str) -> list[int]:
    """The text's ids with an end-of-sequence token in the middle (skipped in the text)."""
    ids = tok.encode(text, add_special_tokens=False)
    return ids[: len(ids) // 2] + [tok.eos_token_id] + ids[len(ids) // 2 :]


@pytest.fixture(params=["smollm2", "byte_fallback"])
def tokenizer(request, smol_tokenizer):
    return smol_tokenizer if request.param == "smollm2" else _byte_fallback()


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_decode(tokenizer, text: str) -> None:
    ids = _ids(tokenizer, text)
    parts, rest = _pieces(tokenizer, ids)
    assert "".join(parts) + rest == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in parts)  # incomplete characters are held back
    assert rest == ""  # the text ends complete: nothing was left held


def test_a_character_split_over_tokens_comes_out_whole() -> None:
    tok = _byte_fallback()
    ids = tok.encode("a🙂", add_special_tokens=False)
    assert len(ids) == 6  # "▁", "a", then four byte tokens
    parts, _ = _pieces(tok, ids)
    assert parts[-4:] == ["", "", "", "🙂"]


def test_what_is_held_at_the_end_is_flushed() -> None:
    tok = _byte_fallback()
    ids = tok.encode("ok🙂", add_special_tokens=False)[:-1]  # the emoji cut short
    parts, rest = _pieces(tok, ids)
    assert "".join(parts) == "ok"
    assert rest == tok.decode(ids)[len("ok") :] and rest.startswith("\ufffd")


def test_a_step_does_not_decode_the_response_again(tokenizer, monkeypatch) -> None:
    calls: list[int] = []
    decode = tokenizer.decode

    def counted(ids, **kw):
        calls.append(len(ids))
        return decode(ids, **kw)

    monkeypatch.setattr(tokenizer, "decode", counted)
    ids = _ids(tokenizer, " ".join(TEXTS) * 4)
    parts, rest = _pieces(tokenizer, ids)
    assert calls == [len(ids)]  # flush's one decode only
    assert "".join(parts) + rest == decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_decodes_the_whole_response(monkeypatch) -> None:
    tok = _byte_fallback()
    tok.clean_up_tokenization_spaces = True  # decode may then differ from the stream's
    calls: list[int] = []
    decode = tok.decode
    counted = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)  # noqa: E731
    monkeypatch.setattr(tok, "decode", counted)
    ids = tok.encode("yes , no . maybe ! end", add_special_tokens=False)
    parts, rest = _pieces(tok, ids)
    assert calls == [*range(1, len(ids) + 1), len(ids)]  # every step, then the flush
    assert "".join(parts) + rest == decode(ids, skip_special_tokens=True)


def test_a_stream_that_fails_falls_back_to_whole_decodes(tokenizer, monkeypatch) -> None:
    ids = _ids(tokenizer, TEXTS[1])
    steps = 0

    class Failing:
        def __init__(self, **kw):
            from tokenizers.decoders import DecodeStream

            self.inner = DecodeStream(**kw)

        def step(self, backend, token_id):
            nonlocal steps
            steps += 1
            if steps == 7:
                raise RuntimeError("invalid prefix")
            return self.inner.step(backend, token_id)

    monkeypatch.setattr("declattn.engine.detok.DecodeStream", Failing)
    parts, rest = _pieces(tokenizer, ids)
    assert steps == 7
    assert "".join(parts) + rest == tokenizer.decode(ids, skip_special_tokens=True)
