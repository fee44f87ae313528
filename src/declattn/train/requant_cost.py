"""What merging an adapter into GGUF blocks costs the model: held-out loss, variant by
variant, on the same teacher-forced sequences.

- ``base``: the base GGUF as the engine serves it (packed blocks);
- ``adapter``: the base's dense bf16 weights with the adapter as a side path (the model
  as trained);
- ``merged``: the adapter merged, every adapted matrix re-rounded in its own format
  against its kept scales (what ``qwen2.5-0.5b-da`` ships), served packed;
- ``merged-<fmt>-<projections>``: the same with some projections written afresh in
  another format (e.g. Q8_0 for the attention), served packed.

The gap between ``adapter`` and ``merged`` is the quality cost of re-quantising; the
gap to ``base`` is what the adapter taught.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from declattn.engine.adapter import adapter_sha256
from declattn.engine.loader import load_model
from declattn.engine.merged import MergeReport, merge_adapter
from declattn.engine.registry import resolve_model
from declattn.train.da_lora import LoRARun, Stream, heldout_loss, load_base
from declattn.train.lora import load_adapter

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Variant:
    name: str
    loss: float
    report: dict[str, float] | None = None  # the merge's totals, for merged variants


def requant_cost(
    adapter_dir: Path, run: LoRARun, heldout: int,
    formats: Sequence[Mapping[str, Q]] = (),
    on_variant: Callable[[Variant], None] | None = None,
) -> list[Variant]:
    """The held-out loss of every variant (see the module docstring) on ``heldout``
    sequences of ``run``'s held-out stream."""
    out: list[Variant] = []

    def done(v: Variant) -> None:
        out.append(v)
        if on_variant:
            on_variant(v)

    dense = load_base(run.base)
    examples = [Stream(run, dense.tokenizer, "heldout").example(i) for i in range(heldout)]
    load_adapter(dense.model, adapter_dir)
    done(Variant("adapter", heldout_loss(dense.model, examples)))
    del dense
    base = resolve_model(run.base)
    done(Variant("base", heldout_loss(load_model(base).model, examples)))
    sha = adapter_sha256(adapter_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for i, fmt in enumerate([{}, *formats]):
            path = Path(tmp) / f"merged{i}.gguf"
            report: MergeReport = merge_adapter(base, adapter_dir, path, None, sha, fmt)
            name = "merged" + "".join(f"-{k}:{v.name}" for k, v in fmt.items())
            model = load_model(path, cache_dir=Path(tmp) / "cache").model
            done(Variant(name, heldout_loss(model, examples), report.totals()))
    return out
