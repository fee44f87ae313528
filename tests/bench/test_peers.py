"""``bench peers``' prompt: the document, the scaffold and the forced output fit the
model's positions whatever the timed tokens (a 32K run with more repeats once asked for
more positions than Qwen2.5 has)."""

from __future__ import annotations

import pytest

from declattn.bench.peers import PeersConfig, _prompt, run_peers


@pytest.mark.parametrize(
    ("context", "repeats", "decode_tokens", "limit"),
    [(4096, 3, 16, 32768), (8192, 9, 25, 8192), (8192, 3, 16, 8192), (6000, 2, 40, 6300)],
)
def test_the_prompt_and_the_forced_output_fit_the_positions(
    smol_tokenizer, context, repeats, decode_tokens, limit
):
    cfg = PeersConfig(contexts=(context,), threads=(1, 2), repeats=repeats,
                      decode_tokens=decode_tokens)
    sessions, tokens, tag_len = _prompt(smol_tokenizer, limit, context, cfg)
    prompt = sessions["da"].prompt_ids
    assert sessions["vanilla"].prompt_ids == prompt
    assert len(prompt) + len(tokens) <= limit
    assert len(prompt) <= context
    assert len(prompt) > 0.9 * min(context, limit - len(tokens))  # not shrunk needlessly
    timed = 2 * repeats * decode_tokens
    assert len(tokens) - tag_len >= timed  # the warm-up and every timed block
    tag = smol_tokenizer.decode(tokens[:tag_len])
    assert tag.startswith("<focus magic_chunks=")


def test_too_many_decoded_tokens_for_the_positions_is_a_clear_error(smol_tokenizer):
    cfg = PeersConfig(contexts=(4096,), threads=(1, 2), repeats=200, decode_tokens=16)
    with pytest.raises(ValueError, match="leave no room for a document"):
        _prompt(smol_tokenizer, 4096, 4096, cfg)


@pytest.mark.parametrize("compare", [("qwen2.5-0.5b",), ("qwen2.5-0.5b-da", "qwen2.5-0.5b-da")])
def test_compare_names_each_other_model_once(compare):
    cfg = PeersConfig(compare=compare, llama_python=None)
    with pytest.raises(ValueError, match="name each model once"):
        run_peers(cfg)  # before any model loads
