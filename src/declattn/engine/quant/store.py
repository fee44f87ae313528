"""The packed layers of a GGUF, cached beside its converted directory, and put in a model.

Decoding and packing a 0.5B model's blocks takes tens of seconds; reading the packed
tensors back takes well under one. The file sits in the GGUF's converted cache entry
(the user's cache, never the network) and its name carries what its bytes depend on:
this module's version, the policy, the activation dtype, and the torch version (the
int4 kernel's packed layout is torch's own and may change between releases).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from declattn.engine.models.config import ModelConfig
from declattn.engine.quant.arena import WeightArena, slot_bytes
from declattn.engine.quant.gguf_weights import QuantPolicy, quantized_layers
from declattn.engine.quant.kernel import gguf_ops
from declattn.engine.quant.linear import GGUFLinear, Int4Linear, Int8Linear, QuantLinear

QUANT_VERSION = "1"
"""Part of every cache file's name: bump it when the packed output changes."""


@dataclass(frozen=True)
class LayerSpec:
    """How to rebuild one packed layer from its tensors."""

    kind: str  # "gguf" | "int4" | "int8"
    in_features: int
    out_features: int
    group: int  # int4: columns per scale; gguf: the ggml type id
    source: str  # the GGUF format it came from, e.g. "Q4_K"
    target: str  # "gguf" | "int4-exact" | "int4" | "int8"


@dataclass(frozen=True)
class QuantSummary:
    """What a quantized load did, for reports: how many matrices went where, and bytes."""

    policy: str
    layers: dict[str, int]  # "Q4_K->int4-exact": count
    packed_bytes: int
    cache_file: str
    cache_hit: bool
    huge_pages: bool = False  # the GGUF blocks' arena asked for 2 MB pages (arena.py)

    def to_dict(self) -> dict:
        return asdict(self)


def cache_path(directory: Path, dtype: torch.dtype, policy: QuantPolicy) -> Path:
    """In a subdirectory: the converted directory's own ``*.safetensors`` are its weights."""
    dt = str(dtype).removeprefix("torch.")
    tv = torch.__version__.replace("+", "-")
    name = f"v{QUANT_VERSION}.{policy.tag()}.{dt}.torch-{tv}.safetensors"
    return directory / "packed" / name


def _spec(layer: QuantLinear, source: str, target: str) -> LayerSpec:
    if isinstance(layer, GGUFLinear):
        kind, group = "gguf", layer.ggml_type
    elif isinstance(layer, Int4Linear):
        kind, group = "int4", layer.group
    else:
        kind, group = "int8", 0
    return LayerSpec(kind, layer.in_features, layer.out_features, group, source, target)


def _build(
    gguf_path: Path, config: ModelConfig, dtype: torch.dtype, policy: QuantPolicy, out: Path
) -> None:
    from safetensors.torch import save_file

    from declattn.engine.gguf_convert import open_gguf

    gg = open_gguf(gguf_path)
    tensors: dict[str, Tensor] = {}
    specs: dict[str, dict] = {}
    for planned, layer in quantized_layers(gg, config, dtype, policy):
        for name, buf in layer.named_buffers():  # GGUF blocks in the file's layout
            tensors[f"{planned.module}.{name}"] = buf.contiguous()
        specs[planned.module] = asdict(_spec(layer, planned.kind.name, planned.target))
    out.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"layers": json.dumps(specs)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)  # a reader never sees half a file
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_packed(
    directory: Path, gguf_path: Path, config: ModelConfig, dtype: torch.dtype, policy: QuantPolicy
) -> tuple[dict[str, QuantLinear], QuantSummary]:
    """The packed layers of ``gguf_path`` by ``Decoder`` module name, from the cache file
    in ``directory`` (built first when absent). Layers have no bias yet (see ``install``).
    GGUF layers' blocks are copied into one ``WeightArena``, never left as views of the
    file (a decode step reads them slower there: arena.py)."""
    from safetensors import safe_open

    if policy.native and gguf_ops() is None:  # no compiler, or chosen off: torch's kernels
        policy = replace(policy, native=False)
    path = cache_path(directory, dtype, policy)
    hit = path.is_file()
    if not hit:
        _build(gguf_path, config, dtype, policy, path)
    layers: dict[str, QuantLinear] = {}
    counts: Counter[str] = Counter()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        specs = json.loads((f.metadata() or {})["layers"])
        arena = WeightArena(sum(
            slot_bytes(math.prod(f.get_slice(f"{m}.blocks").get_shape()))
            for m, raw in specs.items() if raw["kind"] == "gguf"
        ))
        for module, raw in specs.items():
            s = LayerSpec(**raw)
            if s.kind == "gguf":
                layer = GGUFLinear(f.get_tensor(f"{module}.blocks"), s.group, s.in_features)
                layer.blocks = arena.place(layer.blocks)  # out of the file's pages
                layers[module] = layer
            elif s.kind == "int4":
                layers[module] = Int4Linear(
                    f.get_tensor(f"{module}.packed"),
                    f.get_tensor(f"{module}.scales_zeros"),
                    s.in_features,
                    s.out_features,
                    s.group,
                )
            else:
                layers[module] = Int8Linear(
                    f.get_tensor(f"{module}.codes"), f.get_tensor(f"{module}.scales")
                )
            counts[f"{s.source}->{s.target}"] += 1
    packed = sum(m.weight_bytes for m in layers.values())
    return layers, QuantSummary(
        policy.tag(), dict(sorted(counts.items())), packed, str(path), hit, arena.huge_pages
    )


def install(model: nn.Module, layers: dict[str, QuantLinear]) -> set[str]:
    """Put each layer in ``model`` at its module path, in place of the dense one.

    A replaced layer that had a bias gets an empty slot of the same shape (on the meta
    device, like the model it goes into) for the state dict to fill. Returns the names
    of the dense weights no longer needed.
    """
    replaced = set()
    for path, layer in layers.items():
        parent_name, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf, None)
        if isinstance(old, nn.Linear):
            if old.bias is not None:
                layer.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
            replaced.add(f"{path}.weight")
        setattr(parent, leaf, layer)
    return replaced
