"""A tiny random Llama around the real SmolLM2 tokenizer: fast enough to run every arm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from declattn.api import Engine
from declattn.engine.loader import LoadedModel
from declattn.engine.models import Decoder, ModelConfig


def tiny_config(vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def tiny_decoder(vocab: int, seed: int = 0) -> tuple[Decoder, ModelConfig]:
    torch.manual_seed(seed)
    config = ModelConfig.from_hf(tiny_config(vocab))
    model = Decoder(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval(), config


@pytest.fixture(scope="module")
def tiny_engine(smol_tokenizer):
    model, config = tiny_decoder(len(smol_tokenizer))
    return Engine(LoadedModel(model, config, smol_tokenizer, Path(".")), kv_tokens=8192)


@pytest.fixture(scope="module")
def task_data(smol_tokenizer):
    from declattn.eval.tasks import TaskData

    return TaskData.for_tokenizer(smol_tokenizer)
