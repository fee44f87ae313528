"""A LoRA adapter as files (``peft``'s layout) and as the weight updates it makes.

The engine never runs an adapter as a side path: a model with an adapter is served as
its merged weights, re-packed into the base GGUF's own block formats
(``quant/recode.py``, ``engine/merged.py``), so a decode step reads exactly the bytes
the base model reads. This module only reads the factors and forms ``scale * B @ A``.

Files: ``adapter_config.json`` (``peft``'s fields, plus ours under ``"declattn"``) and
``adapter_model.safetensors`` with ``transformers``' tensor names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: ``A`` is
``[rank, in]``, ``B`` ``[out, rank]``), so ``peft`` loads the same adapter onto the
Hugging Face model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from declattn.engine.models.config import ModelConfig
from declattn.engine.models.hf_names import hf_name, internal_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter directory that cannot be read or does not fit the model."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> dict:
        """The fields ``peft.LoraConfig`` reads."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "target_modules": list(self.targets),
        }


@dataclass(frozen=True)
class Adapter:
    """The factors by the path of the weight they adapt (``layers.0.attn.q_proj``)."""

    config: LoRAConfig
    factors: dict[str, tuple[Tensor, Tensor]]  # path -> (A [rank, in], B [out, rank])

    def deltas(self) -> dict[str, Tensor]:
        """``scale * B @ A`` in fp32, by decoder weight name (``layers.0.attn.q_proj.weight``)."""
        s = self.config.scale
        return {f"{p}.weight": s * (b.float() @ a.float()) for p, (a, b) in self.factors.items()}


def lora_tensor_names(config: ModelConfig, path: str) -> tuple[str, str]:
    """The file's names of the ``A`` and ``B`` factors of the weight at ``path``."""
    stem = _PEFT_PREFIX + str(hf_name(config, f"{path}.weight")).removesuffix(".weight")
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def read_adapter(directory: Path, config: ModelConfig) -> Adapter:
    """Read and check an adapter directory against the model it will adapt."""
    from safetensors.torch import load_file

    cfg_path, weights = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise AdapterError(f"{directory}: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(cfg_path.read_text())
        lc = LoRAConfig(int(raw["r"]), float(raw["lora_alpha"]), tuple(raw["target_modules"]))
        tensors = load_file(str(weights))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AdapterError(f"{directory}: unreadable adapter ({e})") from e
    bad = [t for t in lc.targets if t not in PROJECTIONS]
    if bad:
        raise AdapterError(f"{directory}: unknown target modules {bad}")
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(_PEFT_PREFIX) or not key.endswith((".lora_A.weight",
                                                                 ".lora_B.weight")):
            raise AdapterError(f"{weights}: unexpected tensor {key!r}")
        stem, part = key[len(_PEFT_PREFIX) :].rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        try:
            name = internal_name(config, f"{stem}.weight")
        except KeyError:
            name = None
        if name is None:
            raise AdapterError(f"{weights}: {key!r} adapts no weight of this model")
        pairs.setdefault(name.removesuffix(".weight"), {})[part] = t
    factors = {}
    for path, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{weights}: {path} lacks one of its two factors")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape[0] != lc.rank or b.shape[1] != lc.rank:
            raise AdapterError(f"{weights}: {path} is not rank {lc.rank}")
        factors[path] = (a, b)
    return Adapter(lc, factors)


def adapter_sha256(directory: Path) -> str:
    """sha256 of the adapter's weights file."""
    import hashlib

    return hashlib.sha256((directory / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
