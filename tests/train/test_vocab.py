"""The word-level tokenizer: exact round trips, tags as single tokens, a chat template."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from declattn.train.vocab import TAG_TOKENS, build_tokenizer, save_tokenizer, words_of


def test_round_trip_tags_and_chat_template(tmp_path: Path) -> None:
    reply = '<global>e1 3</global><focus magic_chunks="3">e1 e2</focus><answer>e2</answer>'
    texts = ["Magic Chunk 3\nthe red e1 e2 .\n\n", "What does e1 lead to ?", reply]
    save_tokenizer(build_tokenizer(words_of(texts)), tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert "".join(tok.decode([i]) for i in ids) == text
    pieces = tok.convert_ids_to_tokens(tok.encode(reply, add_special_tokens=False))
    assert set(TAG_TOKENS) & set(pieces) >= {'<focus magic_chunks="', '">', "<answer>"}
    assert pieces[pieces.index('<focus magic_chunks="') + 1] == "3"  # ids stay words
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_unknown_words_become_unk_instead_of_failing(tmp_path: Path) -> None:
    save_tokenizer(build_tokenizer(words_of(["a b"])), tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode("a zebra", add_special_tokens=False)[1] == tok.unk_token_id
