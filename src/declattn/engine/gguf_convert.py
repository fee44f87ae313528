"""GGUF file -> Hugging Face config dict and tensors (dequantised to fp32).

llama.cpp's converter renames every tensor, drops config fields it does not need, permutes
the q/k rows of llama-family models for its interleaved RoPE, and stores Gemma's norm
weights with the ``+1`` already added. This module undoes each of those so that the rest
of the engine sees one format only: a Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
"""GGUF ``general.architecture`` -> (Hugging Face architecture, model_type)."""

SETTINGS_KEY = "declattn.settings"
"""Metadata a GGUF written by ``declattn export`` carries: the model's DA settings (its
``declattn.json``, ``{"da": {...}}``) as a JSON string."""
_GEMMA3_SLIDING_PATTERN = 6  # llama.cpp hard-codes this for gemma3; the GGUF omits it
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA3_27B_LAYERS = 62  # the one Gemma 3 whose query scale is hidden/heads, not head_dim

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class GGUFError(ValueError):
    """The file is not a readable GGUF (bad magic, truncated, inconsistent)."""


class GGUFUnsupported(ValueError):
    """A readable GGUF this engine cannot run: architecture or feature named in the message."""


@dataclass
class GGUFModel:
    """An opened GGUF: its reader, and the Hugging Face config built from its metadata."""

    path: Path
    reader: Any  # gguf.GGUFReader
    architecture: str
    config: dict[str, Any]
    has_tokenizer: bool
    settings: dict[str, Any] | None = None  # SETTINGS_KEY, parsed


def open_gguf(path: Path) -> GGUFModel:
    """Parse the header and metadata; raise ``GGUFError`` or ``GGUFUnsupported``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, OSError, ...
        raise GGUFError(f"not a readable GGUF file ({type(e).__name__}: {e})") from e
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise GGUFError(
                f"tensor {tensor.name} is truncated ({tensor.data.nbytes} of "
                f"{tensor.n_bytes} bytes)"
            )
    fields = dict(reader.fields)
    arch = _field(fields, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFUnsupported(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    names = {t.name for t in reader.tensors}
    for name in names:
        hf_name(name, arch)  # fail on an unknown tensor before any dequantisation
    return GGUFModel(
        path=path,
        reader=reader,
        architecture=arch,
        config=_hf_config(fields, arch, names, reader),
        has_tokenizer="tokenizer.ggml.model" in fields,
        settings=_settings(fields),
    )


def _settings(fields: dict[str, Any]) -> dict[str, Any] | None:
    raw = _field(fields, SETTINGS_KEY, None, required=False)
    if raw is None:
        return None
    try:
        settings = json.loads(raw)
    except ValueError as e:
        raise GGUFError(f"metadata field {SETTINGS_KEY!r} is not JSON ({e})") from e
    if not isinstance(settings, dict):
        raise GGUFError(f"metadata field {SETTINGS_KEY!r} is not a JSON object")
    return settings


def hf_tensors(model: GGUFModel) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, fp32 array)`` for every tensor, llama.cpp's edits undone."""
    from gguf.quants import dequantize

    cfg = model.config
    for tensor in model.reader.tensors:
        name = hf_name(tensor.name, model.architecture)
        data = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not data.flags.writeable:  # a view into the read-only file mapping
            data = data.copy()
        expected = tuple(int(n) for n in reversed(tensor.shape))
        if data.shape != expected:
            data = data.reshape(expected)
        if model.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rope(data, cfg["num_attention_heads"])
        elif model.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rope(data, cfg["num_key_value_heads"])
        if model.architecture == "gemma3" and name.endswith("norm.weight"):
            data = data - 1.0
        yield name, data


def hf_name(gguf_name: str, architecture: str) -> str:
    """The Hugging Face name of a GGUF tensor; ``GGUFUnsupported`` for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part == "ffn_norm":
            # the pre-MLP norm: Llama-style models call it post_attention_layernorm
            gemma = architecture == "gemma3"
            role = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        else:
            role = _BLOCK_NAMES.get(part, "")
        if role:
            return f"model.layers.{layer}.{role}.{kind}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFUnsupported("llama3-style RoPE frequency factors (rope_freqs) are not supported")
    raise GGUFUnsupported(f"unexpected tensor {gguf_name!r} for architecture {architecture!r}")


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q/k.

    llama.cpp interleaves each head's rotary pairs (row 2i, 2i+1); Hugging Face keeps the
    halves apart (row i, i + D/2). Per head, rows are stored as [D/2, 2] and read back as
    [2, D/2].
    """
    rows = w.shape[0]
    head_dim = rows // heads
    per_head = w.reshape(heads, head_dim // 2, 2, *w.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(w.shape))


def _field(fields: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
    if key not in fields:
        if required and default is None:
            raise GGUFError(f"metadata field {key!r} missing")
        return default
    try:
        return fields[key].contents()
    except Exception as e:
        raise GGUFError(f"metadata field {key!r} unreadable ({e})") from e


def _hf_config(fields: dict[str, Any], arch: str, names: set[str], reader: Any) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict, in the long-standing field names."""
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        return _field(fields, f"{arch}.{key}", default, required)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise GGUFUnsupported("per-layer kv head counts are not supported")
        kv_heads = kv_heads[0]
    layers = int(get("block_count"))
    head_dim = (
        get("attention.key_length", None, required=False)
        or (get("rope.dimension_count", None, required=False) if arch == "llama" else None)
        or hidden // heads
    )
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError("tensor 'token_embd.weight' missing")
    vocab = int(get("vocab_size", None, required=False) or int(embed.shape[-1]))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length", 0, required=False)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "rope_theta": float(get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10_000.0)),
        "torch_dtype": "float32",
    }
    for key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = _field(fields, f"tokenizer.ggml.{gguf_key}", None, required=False)
        if value is not None:
            config[key] = int(value)
    scaling = get("rope.scaling.type", None, required=False)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFUnsupported(f"unsupported rope scaling type {scaling!r} (only linear)")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(get("rope.scaling.factor")),
        }
    if arch == "qwen2":
        config["attention_bias"] = False  # qwen2's qkv bias is implied by the architecture
    elif arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "gemma3":
        config.update(_gemma3_fields(get, layers, hidden, heads, int(head_dim)))
    else:
        config["hidden_act"] = "silu"
    return config


def _gemma3_fields(get: Any, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """What llama.cpp's gemma3 runtime hard-codes and so the GGUF does not carry."""
    pattern = get("attention.sliding_window_pattern", None, required=False)
    if isinstance(pattern, list):  # one flag per layer, true for sliding
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or _GEMMA3_SLIDING_PATTERN)
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    scalar = hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": layer_types,
        "rope_local_base_freq": float(
            get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE, required=False)
        ),
        "query_pre_attn_scalar": scalar,
    }
    softcap = get("final_logit_softcapping", None, required=False)
    if softcap:
        fields["final_logit_softcapping"] = float(softcap)
    return fields
