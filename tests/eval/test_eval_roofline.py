"""The cost model against hand computations for public-style configs, and its refusals."""

from __future__ import annotations

import json

import pytest

from declattn.eval.accelerators import REGISTRY, Accelerator, resolve
from declattn.eval.roofline import (
    RooflineConfigError,
    model_cost,
    project_steps,
    row_steps,
)
from declattn.eval.rows import STEP_FIELDS

# The shape of Gemma 3 1B's config.json (text model, 5 sliding layers to 1 global).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
    "torch_dtype": "bfloat16",
}
# The shape of Qwen3-0.6B's config.json (no sliding layers in use).
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "sliding_window": None,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_gemma3_per_token_costs_by_hand():
    c = model_cost(GEMMA3_1B)
    # Layers 6, 12, 18, 24 (1-based) are global: 4 of 26.
    assert (c.global_layers, c.sliding_layers, c.sliding_window) == (4, 22, 512)
    # K and V, 1 KV head of 256 dims, 2 bytes: 1,024 bytes per token and layer.
    assert c.kv_bytes_per_token_layer == 2 * 1 * 256 * 2 == 1024
    assert c.kv_bytes_per_token == 26 * 1024
    per_layer = 1152 * 1024 + 2 * 1152 * 256 + 1024 * 1152 + 3 * 1152 * 6912
    assert c.dense_flops_per_token == 2 * (26 * per_layer + 1152 * 262144) == 1_999_503_360


def test_gemma3_h100_projection_by_hand():
    c = model_cost(GEMMA3_1B)
    h100 = REGISTRY["H100"]
    n = 131072
    compute = 1_999_503_360 / (989.4e12 * 0.5)
    full_kv = (4 * n + 22 * 512) * 1024 / (3.35e12 * 0.8)
    half_kv = (4 * n / 2 + 22 * 512) * 1024 / (3.35e12 * 0.8)
    full = c.step_seconds(h100, n, n, mfu=0.5, mbu=0.8)
    half = c.step_seconds(h100, n / 2, n, mfu=0.5, mbu=0.8)
    assert full == pytest.approx(compute + full_kv, rel=1e-12)
    assert half == pytest.approx(compute + half_kv, rel=1e-12)
    assert full == pytest.approx(208.67e-6, rel=1e-3)
    # The paper's kind of figure: DA reading half the context, as a ratio of vanilla.
    assert half / full == pytest.approx(0.5195, rel=1e-3)
    # Short contexts: sliding layers read the whole (shorter) sequence, not the window.
    assert c.kv_bytes_read(100, 100) == (4 * 100 + 22 * 100) * 1024


def test_qwen3_costs_and_a_response_projection():
    c = model_cost(QWEN3_06B)
    assert (c.global_layers, c.sliding_layers) == (28, 0)
    assert c.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2 == 114_688
    acc = Accelerator("toy", 1e12, 1e11, "test")
    steps = [(1000.0, 1000), (200.0, 1001), (200.0, 1002)]
    p = project_steps(c, acc, steps, mfu=0.5, mbu=0.5)
    flops = c.dense_flops_per_token
    assert p.compute_seconds == pytest.approx(3 * flops / 0.5e12)
    assert p.memory_seconds == pytest.approx(1400 * 28 * 4096 / 0.5e11)
    assert p.seconds == pytest.approx(p.compute_seconds + p.memory_seconds)
    heavy = project_steps(c, acc, steps, mfu=0.5, mbu=0.5, include_weights=True)
    assert heavy.memory_seconds - p.memory_seconds == pytest.approx(3 * c.params * 2 / 0.5e11)


def test_dtype_override_and_kv_dtype():
    c = model_cost(QWEN3_06B, dtype="float32", kv_dtype="fp8")
    assert c.weight_bytes_per_param == 4 and c.kv_bytes_per_token_layer == 2 * 8 * 128


def test_nested_text_config_is_read():
    wrapped = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {k: v for k, v in GEMMA3_1B.items() if k != "torch_dtype"},
    }
    assert model_cost(wrapped).kv_bytes_per_token == 26 * 1024


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sliding_window_pattern": None}, "which layers slide"),
        (
            {
                "layer_types": ["sliding_attention"] * 25 + ["full_attention"],
                "sliding_window": None,
            },
            "sliding_window is missing",
        ),
        ({"layer_types": ["full_attention"] * 3}, "lists 3 layers"),
        ({"layer_types": ["linear_attention"] * 26}, "unsupported layer types"),
        ({"torch_dtype": None}, "names no dtype"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_gaps_are_errors_not_guesses(change, message):
    config = {**GEMMA3_1B, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(RooflineConfigError, match=message):
        model_cost(config)


def test_a_sliding_window_nobody_places_is_an_error():
    llama = {**QWEN3_06B, "model_type": "llama", "sliding_window": 4096}
    with pytest.raises(RooflineConfigError, match="which layers slide"):
        model_cost(llama)
    qwen2 = {**QWEN3_06B, "model_type": "qwen2", "use_sliding_window": True}
    del qwen2["max_window_layers"]
    with pytest.raises(RooflineConfigError, match="max_window_layers"):
        model_cost(qwen2)


def test_registry_and_row_steps():
    assert {a.name for a in resolve("all")} == {"A100", "H100", "H200", "B200", "MI300X", "RTX5090"}
    assert [a.name for a in resolve("h200,mi300x")] == ["H200", "MI300X"]
    with pytest.raises(ValueError):
        resolve("tpu")
    row = {
        "step_fields": list(STEP_FIELDS),
        "steps": [["focus", [2], 500, 120, 128, 500, 512, 8, 0, 0, 0.1]],
    }
    assert row_steps(row) == [(120.0, 500)]
    assert row_steps(row, "physical") == [(128.0, 500)]


def test_roofline_command_prints_costs(tmp_path, capsys):
    from declattn.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_1B))
    assert (
        main(["roofline", "--config", str(path), "--accelerators", "h100", "--context", "128K"])
        == 0
    )
    out = capsys.readouterr().out
    assert "26,624" in out and "0.52x" in out
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"})
    )
    assert main(["roofline", "--config", str(bad)]) == 2


def test_run_dtype_is_read_from_rows():
    from declattn.eval.roofline import rows_kv_dtype

    c = model_cost(QWEN3_06B)
    recorded = [{"kv_dtype": "float32"}]
    assert rows_kv_dtype(recorded, c) == "float32"
    # Older rows: 2 bytes per value, from the global-layer bytes a step counted.
    per_pos = 2 * 8 * 128 * 28 * 2
    step = ["global", [], 300, 300, 304, 300, 304, 19, 300 * per_pos, 0, 0.1]
    row = {"step_fields": list(STEP_FIELDS), "steps": [step]}
    assert rows_kv_dtype([row], c) == "bfloat16"
    assert rows_kv_dtype([{"steps": []}], c) is None
