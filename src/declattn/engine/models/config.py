"""One config for every supported decoder family, read from a Hugging Face ``config.json``.

The families differ in a handful of switches (qkv bias, q/k norms, sandwich norms, the
``1 + weight`` norm convention, embedding scale, activation, per-layer sliding windows,
two RoPE bases). Reading them into flags here lets one ``Decoder`` serve all of them, and
keeps every quirk of the Hugging Face formats (old ``rope_theta``/``rope_scaling`` fields
and the newer ``rope_parameters``) in this one file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "DeclattnTinyForCausalLM": "declattn_tiny",
}
"""Hugging Face architecture name -> family. ``declattn_tiny`` is Llama plus the two
learning aids of ``da-tiny`` (see ``Decoder``); only this engine runs it."""

_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "declattn_tiny": "declattn_tiny",
}

_DEFAULT_THETA = {
    "declattn_tiny": 10_000.0,
    "llama": 10_000.0,
    "qwen2": 10_000.0,
    "qwen3": 10_000.0,
    "gemma3": 1_000_000.0,
}
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_QUERY_SCALAR = 256
_GEMMA3_WINDOW = 4096

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


class ConfigError(ValueError):
    """A ``config.json`` that this engine cannot run: a field missing or out of range."""


class UnsupportedArchitecture(ConfigError):
    """The architecture is not one this engine implements."""

    def __init__(self, name: str) -> None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        super().__init__(f"unsupported architecture {name!r}; supported: {supported}")
        self.name = name


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies: a base and an optional scaling rule."""

    theta: float
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, as flags rather than family names."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    activation: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sandwich_norms: bool
    norm_unit_offset: bool
    embed_scale: float | None
    attn_scale: float
    layer_windows: tuple[int | None, ...]
    rope_global: RopeConfig
    rope_local: RopeConfig | None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    token_shift: int = 0  # declattn_tiny: previous tokens mixed into each embedding
    chunk_segments: int = 0  # declattn_tiny: chunk ids with an embedding of their own

    @property
    def needs_token_context(self) -> bool:
        """Whether the decoder must be told each token's neighbours and chunk."""
        return bool(self.token_shift or self.chunk_segments)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``; ``None`` for a global layer."""
        return self.layer_windows[layer]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict; raise ``ConfigError`` on anything unclear."""
        architecture, family = _architecture(d)
        hidden = _req_int(d, "hidden_size")
        layers = _req_int(d, "num_hidden_layers")
        heads = _req_int(d, "num_attention_heads")
        kv_heads = _opt_int(d, "num_key_value_heads") or heads
        head_dim = _opt_int(d, "head_dim") or hidden // heads
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}"
            )
        gemma = family == "gemma3"
        act_name = (
            d.get("hidden_activation")
            or d.get("hidden_act")
            or ("gelu_pytorch_tanh" if gemma else "silu")
        )
        if act_name not in _ACTIVATIONS:
            raise ConfigError(
                f"unsupported activation {act_name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
            )
        if d.get("attn_logit_softcapping") is not None:
            raise ConfigError("attn_logit_softcapping is not supported")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor other than 1.0 is not supported")
        rope_global, rope_local = _rope(d, family)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if d.get("use_bidirectional_attention"):
            raise ConfigError("bidirectional attention (an embedding model) is not supported")
        # Gemma's query scale has its own field, defaulting to 256 as in the reference code.
        scalar = d.get("query_pre_attn_scalar", _GEMMA3_QUERY_SCALAR) if gemma else None
        softcap = d.get("final_logit_softcapping")
        return cls(
            architecture=architecture,
            family=family,
            vocab_size=_req_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req_int(d, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            activation=_ACTIVATIONS[act_name],
            qkv_bias=bool(d.get("attention_bias", False)) or family == "qwen2",
            o_bias=bool(d.get("attention_bias", False)) and family != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3"),
            sandwich_norms=gemma,
            norm_unit_offset=gemma,
            embed_scale=math.sqrt(hidden) if gemma else None,
            attn_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
            layer_windows=_layer_windows(d, family, layers),
            rope_global=rope_global,
            rope_local=rope_local,
            final_logit_softcap=None if softcap is None else float(softcap),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            token_shift=_req_int(d, "token_shift") if family == "declattn_tiny" else 0,
            chunk_segments=_req_int(d, "chunk_segments") if family == "declattn_tiny" else 0,
        )


def _architecture(d: dict[str, Any]) -> tuple[str, str]:
    archs = d.get("architectures") or []
    for name in archs:
        if name in SUPPORTED_ARCHITECTURES:
            return name, SUPPORTED_ARCHITECTURES[name]
    if archs:
        raise UnsupportedArchitecture(archs[0])
    model_type = d.get("model_type")
    if model_type in _MODEL_TYPES:
        family = _MODEL_TYPES[model_type]
        name = next(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == family)
        return name, family
    if model_type is None:
        raise ConfigError("config has neither 'architectures' nor 'model_type'")
    raise UnsupportedArchitecture(str(model_type))


def _req_int(d: dict[str, Any], key: str) -> int:
    if d.get(key) is None:
        raise ConfigError(f"missing required field {key!r}")
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"field {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else _req_int(d, key)


def _layer_windows(d: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window, from ``layer_types`` or the older pattern fields."""
    types = d.get("layer_types")
    if types is None and family == "gemma3":
        pattern = int(d.get("sliding_window_pattern") or _GEMMA3_SLIDING_PATTERN)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if types is None and d.get("use_sliding_window") and d.get("sliding_window"):
        first = int(d.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return (None,) * layers
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    window = d.get("sliding_window", _GEMMA3_WINDOW if family == "gemma3" else None)
    out: list[int | None] = []
    for kind in types:
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise ConfigError("a sliding_attention layer needs a positive 'sliding_window'")
            out.append(int(window))
        else:
            raise ConfigError(f"unsupported layer type {kind!r}")
    return tuple(out)


def _rope(d: dict[str, Any], family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """Global and (Gemma 3) local RoPE, from either config format."""
    params = d.get("rope_parameters")
    local_params: dict[str, Any] | None = None
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        global_params = dict(params.get("full_attention") or {})
        local_params = dict(params.get("sliding_attention") or {})
    elif isinstance(params, dict):
        global_params = dict(params)
    else:
        global_params = dict(d.get("rope_scaling") or {})
    global_params.setdefault("rope_theta", d.get("rope_theta") or _DEFAULT_THETA[family])
    rope_global = _rope_one(global_params)
    if family != "gemma3":
        return rope_global, None
    if local_params is None:
        local_params = {}
    local_params.setdefault("rope_theta", d.get("rope_local_base_freq") or _GEMMA3_LOCAL_THETA)
    return rope_global, _rope_one(local_params)


def _rope_one(p: dict[str, Any]) -> RopeConfig:
    kind = p.get("rope_type") or p.get("type") or "default"
    theta = float(p["rope_theta"])
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(p["factor"]))
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=theta,
                kind="llama3",
                factor=float(p["factor"]),
                low_freq_factor=float(p["low_freq_factor"]),
                high_freq_factor=float(p["high_freq_factor"]),
                original_max_position_embeddings=int(p["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"llama3 rope scaling lacks field {e.args[0]!r}") from None
    raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")
