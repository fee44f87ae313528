"""A base GGUF plus a LoRA adapter, written as one GGUF: the merged model.

Each adapted matrix becomes ``W + scale * B @ A`` re-rounded into the base file's own
blocks (``quant/recode.py``: same format, same scales, new codes), every other tensor
and every metadata field is copied as it is, and the model's DA settings ride along as
the metadata field ``declattn.settings`` (the JSON of its ``declattn.json``), which
the loader writes back beside the converted weights. The result is an ordinary GGUF:
this engine serves it at the base model's decode speed (the same formats, the same
bytes per step), and llama.cpp loads it like the base.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from declattn.engine.adapter import Adapter, read_adapter
from declattn.engine.gguf_convert import SETTINGS_KEY, hf_name, open_gguf, unpermute_rope
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.hf_names import internal_name
from declattn.engine.quant.blocks import group_codes
from declattn.engine.quant.recode import RECODABLE, rerounded

Q = GGMLQuantizationType

ADAPTER_KEY = "declattn.adapter.sha256"
MERGE_VERSION = "1"
"""Part of a cached merged model's identity: bump it when merging writes other bytes."""
_FLOATS = {Q.F32: np.float32, Q.F16: np.float16}


@dataclass
class MergeReport:
    """What merging did to each adapted matrix: how many codes changed, and how much of
    the adapter's update the re-rounded weight carries (``kept``: the share of the
    update's squared norm that the new weight's change from the base reproduces;
    ``error``: the norm of the gap to the exact merged weight over the update's)."""

    tensors: dict[str, dict[str, float]] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        t = self.tensors.values()
        n = sum(x["codes"] for x in t)
        return {
            "matrices": len(self.tensors),
            "codes_changed": sum(x["changed"] for x in t) / max(1, n),
            "kept": sum(x["kept"] * x["update_sq"] for x in t)
            / max(1e-30, sum(x["update_sq"] for x in t)),
            "error": float(np.sqrt(sum(x["error_sq"] for x in t)
                                   / max(1e-30, sum(x["update_sq"] for x in t)))),
        }


def _gguf_order(
    config: ModelConfig, module: str, rows: int, architecture: str
) -> np.ndarray | None:
    """llama.cpp's row order of a llama q/k matrix: row ``order[i]`` of the file is row
    ``i`` of the Hugging Face matrix."""
    if architecture != "llama" or not module.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
    return unpermute_rope(np.arange(rows)[:, None], heads)[:, 0]


def _merged_tensor(
    data: np.ndarray, kind: Q, delta: np.ndarray, report: MergeReport, name: str,
    target: Q | None = None,
) -> tuple[np.ndarray, Q]:
    """The merged tensor's data and format: ``kind`` re-rounded (``recode``), or, where
    ``target`` names another format, the merged weight quantised afresh in it."""
    from gguf.quants import dequantize, quantize

    rows, cols = delta.shape
    if target is not None and target != kind:
        base = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, cols)
        out = quantize(base + delta, target)
        got = np.asarray(dequantize(out, target), dtype=np.float32).reshape(rows, cols) - base
        changed, codes = rows * cols, rows * cols
        kind = target
    elif kind in _FLOATS:
        base = np.asarray(data, dtype=np.float32).reshape(rows, cols)
        new = (base + delta).astype(_FLOATS[kind])
        got = new.astype(np.float32) - base
        changed, codes = int((got != 0).sum()), rows * cols
        out = new.reshape(np.shape(data))
    elif kind in RECODABLE:
        g = group_codes(data, kind, (rows, cols))
        base = g.dequantize()
        out = rerounded(data, kind, base + delta)
        after = group_codes(out, kind, (rows, cols))
        got = after.dequantize() - base
        changed, codes = int((after.codes != g.codes).sum()), rows * cols
    else:
        raise NotImplementedError(f"{name}: cannot merge into a {kind.name} tensor")
    update_sq = float((delta.astype(np.float64) ** 2).sum())
    report.tensors[name] = {
        "codes": codes, "changed": changed, "update_sq": update_sq,
        "kept": float((got.astype(np.float64) * delta).sum()) / max(1e-30, update_sq),
        "error_sq": float(((got - delta).astype(np.float64) ** 2).sum()),
    }
    return out, kind


def merge_adapter(
    base: Path, adapter_dir: Path, out: Path, settings: dict | None = None,
    adapter_sha256: str | None = None, formats: Mapping[str, Q] | None = None,
) -> MergeReport:
    """Write ``out``: ``base`` with the adapter in ``adapter_dir`` merged (see the module
    docstring). ``settings`` (``{"da": {...}}``) go into the metadata. ``formats``: a
    format by projection name (``"q_proj": Q.Q8_0``) for adapted matrices to be written
    in afresh instead of re-rounded in their own. The file appears whole or not at all."""
    import gguf

    gg = open_gguf(base)
    config = ModelConfig.from_hf(gg.config)
    adapter: Adapter = read_adapter(adapter_dir, config)
    deltas = {k: v.numpy() for k, v in adapter.deltas().items()}
    reader = gg.reader
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    report = MergeReport()
    try:
        writer = gguf.GGUFWriter(str(tmp), gg.architecture)
        for f in reader.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
                continue
            if f.name in (SETTINGS_KEY, ADAPTER_KEY):
                continue
            kind = f.types[0]
            sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), kind, sub_type=sub)
        if settings is not None:
            writer.add_string(SETTINGS_KEY, json.dumps(settings, sort_keys=True))
        if adapter_sha256 is not None:
            writer.add_string(ADAPTER_KEY, adapter_sha256)
        tensors: list[np.ndarray] = []
        used = set()
        for t in reader.tensors:
            data = t.data
            name = internal_name(config, hf_name(t.name, gg.architecture))
            if name is not None and name in deltas:
                delta = deltas[name]
                order = _gguf_order(config, name.removesuffix(".weight"), delta.shape[0],
                                    gg.architecture)
                if order is not None:
                    permuted = np.empty_like(delta)
                    permuted[order] = delta
                    delta = permuted
                proj = name.removesuffix(".weight").rsplit(".", 1)[-1]
                target = (formats or {}).get(proj)
                data, kind = _merged_tensor(t.data, Q(t.tensor_type), delta, report, name,
                                            target)
                used.add(name)
            else:
                kind = Q(t.tensor_type)
            tensors.append(data)
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
        missing = sorted(set(deltas) - used)
        if missing:
            raise ValueError(f"{base}: no tensor for the adapter's {', '.join(missing[:3])}")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in tensors:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return report
