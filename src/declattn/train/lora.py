"""Low-rank adapters (LoRA) on the engine's own ``Decoder``, for training over dense weights.

Why our own layer and not ``peft``: ``peft`` wraps ``transformers`` models (it finds
layers by the module names of a ``PreTrainedModel`` and hooks its forward), while the
model trained here is the engine's ``Decoder``, whose projections are plain
``nn.Linear`` children of ``Attention`` and ``MLP``; a LoRA layer is twenty lines, and
the adapter is saved in ``peft``'s file layout (``adapter_config.json`` and
``adapter_model.safetensors`` under ``transformers``' tensor names) so that ``peft`` users
can load it on the Hugging Face model all the same (``engine/adapter.py`` reads it back).

The base weight stays frozen in the model's dtype (bf16 for training on CPU); the two
factors are fp32 parameters, and the side path computes in fp32 and is added to the
base output in the base's dtype. ``B`` starts at zero, so an adapter that has not been
trained changes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from declattn.engine.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoRAConfig,
    lora_tensor_names,
    read_adapter,
)
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.decoder import Decoder

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
"""Every projection but ``down_proj``: see docs/training.md (the merged adapter is
re-packed into the GGUF's own formats; these are the ones whose blocks we re-round)."""


class LoRALinear(nn.Module):
    """``base(x) + scale * (x A^T) B^T`` with ``A`` ``[rank, in]``, ``B`` ``[out, rank]``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, seed: int = 0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        gen = torch.Generator().manual_seed(seed)
        a = torch.empty(rank, base.in_features)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming-uniform with a = sqrt(5)
        a.uniform_(-bound, bound, generator=gen)
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def delta(self) -> Tensor:
        """The fp32 ``[out, in]`` update the adapter adds to the base weight."""
        return self.scale * (self.lora_b @ self.lora_a)

    def forward(self, x: Tensor) -> Tensor:
        side = (x.float() @ self.lora_a.t()) @ self.lora_b.t()
        return self.base(x) + (self.scale * side).to(x.dtype)


@dataclass(frozen=True)
class LoRASpec:
    """Which projections get an adapter, and its size."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def config(self) -> LoRAConfig:
        return LoRAConfig(self.rank, self.alpha, self.targets)


def _owners(model: Decoder) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every attention and MLP: the modules holding projections."""
    out = []
    for i, layer in enumerate(model.layers):
        out.append((f"layers.{i}.attn", layer.attn))
        out.append((f"layers.{i}.mlp", layer.mlp))
    return out


def apply_lora(model: Decoder, spec: LoRASpec, seed: int = 0) -> dict[str, LoRALinear]:
    """Freeze every weight of ``model`` and wrap the target projections in place.
    Returns the adapters by the path of the weight they adapt (``layers.0.attn.q_proj``)."""
    for p in model.parameters():
        p.requires_grad_(False)
    made: dict[str, LoRALinear] = {}
    for path, owner in _owners(model):
        for name in spec.targets:
            base = getattr(owner, name, None)
            if base is None:
                continue
            if not isinstance(base, nn.Linear):
                raise TypeError(
                    f"{path}.{name} is a {type(base).__name__}, not a dense nn.Linear: load "
                    "the model with dense weights (load_model(..., quantize=False)) to train"
                )
            lora = LoRALinear(base, spec.rank, spec.alpha, seed=seed + len(made))
            setattr(owner, name, lora)
            made[f"{path}.{name}"] = lora
    if not made:
        raise ValueError(f"no projection named {', '.join(spec.targets)} in the model")
    return made


def adapters_of(model: Decoder) -> dict[str, LoRALinear]:
    """The LoRA layers of ``model`` by weight path."""
    out = {}
    for path, owner in _owners(model):
        for name, child in owner.named_children():
            if isinstance(child, LoRALinear):
                out[f"{path}.{name}"] = child
    return out


def merge_lora(model: Decoder) -> int:
    """Fold every adapter into its base weight (in the base's dtype) and put the plain
    ``nn.Linear`` back. Returns how many were merged."""
    n = 0
    for _, owner in _owners(model):
        for name, child in list(owner.named_children()):
            if isinstance(child, LoRALinear):
                w = child.base.weight
                with torch.no_grad():
                    w.copy_((w.float() + child.delta()).to(w.dtype))
                setattr(owner, name, child.base)
                n += 1
    return n


def save_adapter(
    model: Decoder, config: ModelConfig, spec: LoRASpec, out: Path, base_name: str,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` (``peft``'s layout,
    ``transformers``' tensor names) into ``out``; returns the weights file."""
    from safetensors.torch import save_file

    adapters = adapters_of(model)
    if not adapters:
        raise ValueError("the model has no LoRA layers to save")
    state = {}
    for path, lora in adapters.items():
        a_name, b_name = lora_tensor_names(config, path)
        state[a_name] = lora.lora_a.detach().to(dtype).contiguous()
        state[b_name] = lora.lora_b.detach().to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    weights = out / ADAPTER_WEIGHTS
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # written private; an adapter is not a secret, and it ships
    lc = spec.config()
    body = {**lc.peft_config(), "base_model_name_or_path": base_name, "declattn": asdict(lc)}
    (out / ADAPTER_CONFIG).write_text(json.dumps(body, indent=2) + "\n")
    return weights


def load_adapter(model: Decoder, directory: Path, seed: int = 0) -> dict[str, LoRALinear]:
    """Wrap ``model``'s projections and set the factors from a saved adapter."""
    adapter = read_adapter(directory, model.config)
    spec = LoRASpec(adapter.config.rank, adapter.config.alpha, adapter.config.targets)
    made = apply_lora(model, spec, seed)
    missing = sorted(set(made) - set(adapter.factors))
    if missing:
        raise ValueError(f"{directory}: adapter lacks {', '.join(missing[:3])}")
    with torch.no_grad():
        for path, lora in made.items():
            a, b = adapter.factors[path]
            lora.lora_a.copy_(a.float())
            lora.lora_b.copy_(b.float())
    return made


def trainable(model: nn.Module) -> Sequence[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
