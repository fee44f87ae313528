"""A tiny random model and a one-character-per-id tokenizer: engine tests' world."""

from __future__ import annotations

import torch

from declattn.engine.models import Decoder, ModelConfig

VOCAB = 512


class Tok:
    """A tokenizer stand-in for engine tests: id -> one printable character."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + i) for i in ids)


def tiny_model(seed: int = 0, family: str = "llama") -> Decoder:
    cfg = {
        "architectures": ["LlamaForCausalLM"] if family == "llama" else ["Qwen2ForCausalLM"],
        "model_type": family,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    torch.manual_seed(seed)
    model = Decoder(ModelConfig.from_hf(cfg)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()
