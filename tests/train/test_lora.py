"""LoRA on the engine's Decoder: a zero update is the base, merging equals the side path,
and an adapter saved in peft's layout loads back to the same logits."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from declattn.engine.adapter import AdapterError, read_adapter
from declattn.engine.models.config import ModelConfig
from declattn.train.lora import (
    LoRASpec,
    adapters_of,
    apply_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)
from declattn.train.trainer import MaskedAttention

TOL = 1e-4
"""fp32 throughout: the merged weight and the side path differ only in summation order."""


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[0]
    mask = torch.ones(1, n, n, dtype=torch.bool).tril()
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(n), MaskedAttention(mask)))


def _trained(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Give every adapter random, non-zero factors (as training would)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in adapters_of(model).values():
            lora.lora_b.copy_(torch.randn(lora.lora_b.shape, generator=gen) * 0.05)
    return model


@pytest.fixture
def plain(tiny_tok: object) -> torch.nn.Module:
    """An untrained plain Llama (2 layers, d=128) in fp32."""
    from declattn.train.da_tiny import TinySpec, hf_config, new_model

    spec = TinySpec(layers=2, aids=False)
    return new_model(hf_config(spec, len(tiny_tok), tiny_tok.eos_token_id), seed=1).eval()


def test_a_fresh_adapter_changes_nothing(plain: torch.nn.Module) -> None:
    ids = torch.randint(0, plain.config.vocab_size, (24,))
    before = _logits(plain, ids)
    made = apply_lora(plain, LoRASpec(rank=4, alpha=8.0))
    assert len(made) == 6 * plain.config.num_layers
    assert all(not x.lora_b.detach().any() for x in made.values())
    assert torch.equal(_logits(plain, ids), before)
    frozen = [n for n, p in plain.named_parameters() if p.requires_grad and "lora_" not in n]
    assert frozen == []


def test_merging_equals_the_side_path(plain: torch.nn.Module) -> None:
    ids = torch.randint(0, plain.config.vocab_size, (24,))
    base = _logits(plain, ids)
    apply_lora(plain, LoRASpec(rank=4, alpha=8.0))
    side = _logits(_trained(plain), ids)
    assert (side - base).abs().max() > 1e-2  # the update is visible
    assert merge_lora(plain) == 6 * plain.config.num_layers
    assert adapters_of(plain) == {}
    assert torch.allclose(_logits(plain, ids), side, atol=TOL, rtol=0)


def test_a_saved_adapter_loads_to_the_same_logits(plain: torch.nn.Module, tmp_path: Path) -> None:
    ids = torch.randint(0, plain.config.vocab_size, (24,))
    fresh = copy.deepcopy(plain)
    apply_lora(plain, LoRASpec(rank=4, alpha=8.0))
    _trained(plain)
    side = _logits(plain, ids)
    config: ModelConfig = plain.config
    save_adapter(plain, config, LoRASpec(rank=4, alpha=8.0), tmp_path, "tiny",
                 dtype=torch.float32)
    adapter = read_adapter(tmp_path, config)
    assert adapter.config.rank == 4 and len(adapter.factors) == 6 * config.num_layers
    assert "layers.0.attn.q_proj.weight" in adapter.deltas()
    load_adapter(fresh, tmp_path)
    assert torch.allclose(_logits(fresh, ids), side, atol=TOL, rtol=0)


def test_an_adapter_of_another_shape_is_refused(plain: torch.nn.Module, tmp_path: Path) -> None:
    apply_lora(plain, LoRASpec(rank=2, alpha=4.0))
    save_adapter(plain, plain.config, LoRASpec(rank=4, alpha=4.0), tmp_path, "tiny")
    with pytest.raises(AdapterError, match="not rank 4"):
        read_adapter(tmp_path, plain.config)


def test_training_needs_dense_weights(plain: torch.nn.Module) -> None:
    from declattn.engine.quant.linear import Int8Linear

    layer = plain.layers[0].attn
    layer.q_proj = Int8Linear.from_float(layer.q_proj.weight.detach(), torch.float32)
    with pytest.raises(TypeError, match="dense nn.Linear"):
        apply_lora(plain, LoRASpec())
