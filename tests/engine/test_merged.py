"""A LoRA adapter merged into a GGUF: the adapted matrices move by the update (to half a
step of each group's kept scale), everything else is the base's bytes, and the model's
DA settings come back as its declattn.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from declattn.engine.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAConfig, lora_tensor_names
from declattn.engine.gguf_convert import open_gguf, unpermute_rope
from declattn.engine.loader import load_model
from declattn.engine.merged import merge_adapter
from declattn.engine.models.config import ModelConfig
from declattn.engine.quant.blocks import group_codes
from declattn.engine.registry import resolve_model

pytestmark = [pytest.mark.model, pytest.mark.slow]
TARGETS = ("q_proj", "v_proj", "up_proj")


def _adapter(directory: Path, config: ModelConfig, rank: int = 4) -> dict[str, torch.Tensor]:
    """A random adapter on three projections of layer 0, large enough to move codes by
    several steps; returns the deltas by weight name."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    state, deltas = {}, {}
    lc = LoRAConfig(rank, float(rank), TARGETS)
    for proj in TARGETS:
        owner = "mlp" if proj == "up_proj" else "attn"
        w = f"layers.0.{owner}.{proj}"
        out_f = config.intermediate_size if proj == "up_proj" else (
            config.num_heads if proj == "q_proj" else config.num_kv_heads) * config.head_dim
        a = torch.randn(rank, config.hidden_size, generator=gen) * 0.1
        b = torch.randn(out_f, rank, generator=gen) * 0.1
        an, bn = lora_tensor_names(config, w)
        state[an], state[bn] = a, b
        deltas[f"{w}.weight"] = lc.scale * (b @ a)
    save_file(state, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(lc.peft_config()))
    return deltas


def test_merging_moves_the_adapted_weights_and_nothing_else(tmp_path: Path) -> None:
    base = resolve_model("smollm2-135m")  # a llama: q/k rows are permuted in the file
    gg = open_gguf(base)
    config = ModelConfig.from_hf(gg.config)
    deltas = _adapter(tmp_path, config)
    settings = {"da": {"target": 512, "focus": "find"}}
    out = tmp_path / "merged.gguf"
    report = merge_adapter(base, tmp_path, out, settings, "abc")
    t = report.totals()
    assert t["matrices"] == 3 and t["codes_changed"] > 0.1 and t["kept"] > 0.6, t
    merged = {x.name: x for x in open_gguf(out).reader.tensors}
    changed = {"blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_up.weight"}
    for x in gg.reader.tensors:
        same = np.array_equal(np.asarray(x.data), np.asarray(merged[x.name].data))
        assert same == (x.name not in changed), x.name
        assert merged[x.name].tensor_type == x.tensor_type
    steps, ends = {}, {}  # each weight's step and where its new code hit a group's end
    for gguf_name, name, heads in (("blk.0.attn_q.weight", "layers.0.attn.q_proj.weight",
                                    config.num_heads),
                                   ("blk.0.attn_v.weight", "layers.0.attn.v_proj.weight", 0),
                                   ("blk.0.ffn_up.weight", "layers.0.mlp.up_proj.weight", 0)):
        x = next(t for t in gg.reader.tensors if t.name == gguf_name)
        shape = (int(x.shape[1]), int(x.shape[0]))
        step = np.repeat(group_codes(x.data, Q(x.tensor_type), shape).scale, 32, axis=1)
        new = group_codes(merged[gguf_name].data, Q(x.tensor_type), shape).codes
        end = (new == 0) | (new == 15)
        steps[name] = unpermute_rope(step, heads) if heads else step
        ends[name] = unpermute_rope(end, heads) if heads else end
    # dense loads of both: the difference is the update, row order and all
    cache = tmp_path / "cache"
    a = load_model(base, dtype=torch.float32, cache_dir=cache).model.state_dict()
    loaded = load_model(out, dtype=torch.float32, cache_dir=cache)
    b = loaded.model.state_dict()
    for name, delta in deltas.items():
        got = (b[name] - a[name]).numpy()
        near = np.abs(got - delta.numpy()) <= steps[name] / 2 + 1e-6
        assert near[~ends[name]].all(), name  # to half a step, where no code was clipped
        # an update of one or two steps, rounded: ~0.7; a wrong row order (llama's q) ~0
        assert np.corrcoef(got.ravel(), delta.numpy().ravel())[0, 1] > 0.5, name
    assert torch.equal(a["layers.1.attn.q_proj.weight"], b["layers.1.attn.q_proj.weight"])
    written = json.loads((loaded.weights_dir / "declattn.json").read_text())
    assert written == settings
