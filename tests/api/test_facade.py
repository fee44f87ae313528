"""``declattn.Engine``: how it sizes the KV pool its sequences share."""

from __future__ import annotations

from pathlib import Path

import pytest

from declattn.api import DEFAULT_KV_TOKENS, Engine
from declattn.engine.loader import LoadedModel
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.decoder import Decoder


@pytest.fixture(scope="module")
def loaded(smol_tokenizer) -> LoadedModel:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": len(smol_tokenizer), "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": True,
    }
    config = ModelConfig.from_hf(cfg)
    return LoadedModel(Decoder(config).float().eval(), config, smol_tokenizer, Path("."))


def test_the_default_pool_holds_one_whole_context_when_that_is_smaller(loaded) -> None:
    assert 1024 + 16 < DEFAULT_KV_TOKENS
    assert Engine(loaded).pool.num_blocks == (1024 + 16) // 16


def test_an_explicit_pool_is_kept_even_beyond_one_context(loaded) -> None:
    # a batch of many sequences needs more than one sequence's context
    assert Engine(loaded, kv_tokens=64 * 1024).pool.num_blocks == 4096
    assert Engine(loaded, kv_tokens=20).pool.num_blocks == 2  # whole blocks


def test_an_empty_pool_is_refused(loaded) -> None:
    with pytest.raises(ValueError, match="kv_tokens"):
        Engine(loaded, kv_tokens=0)
