"""Hugging Face checkpoint tensor names -> ``Decoder`` parameter names.

The decoder names its norms by role (``attn_norm``, ``mlp_norm``, ``post_attn_norm``,
``post_mlp_norm``) because Hugging Face reuses one name for two roles: Llama's
``post_attention_layernorm`` is the norm *before* the MLP, Gemma's is the norm *after*
attention. This table is the one place that knows the difference.
"""

from __future__ import annotations

import re

from declattn.engine.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    **{
        f"self_attn.{proj}.{kind}": f"attn.{proj}.{kind}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        for kind in ("weight", "bias")
    },
    **{
        f"mlp.{proj}.{kind}": f"mlp.{proj}.{kind}"
        for proj in ("gate_proj", "up_proj", "down_proj")
        for kind in ("weight", "bias")
    },
}


def internal_name(config: ModelConfig, hf_name: str) -> str | None:
    """The decoder parameter for ``hf_name``; ``None`` for tensors the decoder does not use.

    Raises ``KeyError`` for a name that belongs to no known role, so that a checkpoint of
    an unexpected shape fails loudly instead of loading partially.
    """
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed.weight"
    if hf_name == "model.norm.weight":
        return "norm.weight"
    if hf_name == "model.segment_embed.weight" and config.chunk_segments:
        return "segment_embed.weight"
    shift = re.match(r"^model\.token_shift\.(\d+)\.weight$", hf_name)
    if shift is not None and int(shift.group(1)) < config.token_shift:
        return f"shift.{shift.group(1)}.weight"
    if hf_name == "lm_head.weight":
        return None if config.tie_word_embeddings else "lm_head.weight"
    match = _LAYER.match(hf_name)
    if match is None:
        raise KeyError(hf_name)
    layer, rest = match.groups()
    if rest == "post_attention_layernorm.weight":
        role = "post_attn_norm.weight" if config.sandwich_norms else "mlp_norm.weight"
    elif rest in _LAYER_NAMES:
        role = _LAYER_NAMES[rest]
    else:
        raise KeyError(hf_name)
    return f"layers.{layer}.{role}"


def hf_name(config: ModelConfig, name: str) -> str | None:
    """The Hugging Face tensor name of decoder parameter ``name`` (the inverse of
    ``internal_name``); ``None`` for a parameter a checkpoint does not store."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "segment_embed.weight":
        return "model.segment_embed.weight"
    if name.startswith("shift."):
        return f"model.token_shift.{name.split('.')[1]}.weight"
    if name == "lm_head.weight":
        return None if config.tie_word_embeddings else "lm_head.weight"
    match = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if match is None:
        raise KeyError(name)
    layer, role = match.groups()
    norm_after_attn = "post_attn_norm.weight" if config.sandwich_norms else "mlp_norm.weight"
    if role == norm_after_attn:
        return f"model.layers.{layer}.post_attention_layernorm.weight"
    for hf, internal in _LAYER_NAMES.items():
        if internal == role:
            return f"model.layers.{layer}.{hf}"
    raise KeyError(name)
