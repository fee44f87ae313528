"""``declattn bench decode``: does reading fewer KV blocks make decode faster, by how much.

Three parts, each in one process with its own bandwidth or baseline measured beside it:

- ``micro``: one decode row's attention per mode (global, focus, local) over synthetic
  KV at each context, per decode path (fused kernel, torch fallback) and thread count,
  against the bytes each must read and the machine's bandwidth at that thread count;
- ``e2e``: a forced DA transcript decoded with DA masking and with vanilla masking, on
  a KV-heavy random-weight model and on SmolLM2, against the roofline ratio;
- ``hf``: our engine against ``transformers`` ``generate`` on SmolLM2's weights.

Timings on a shared CPU move with the neighbours' load: every result carries the load
average before and after its part, best-of and median, and the ratios are always of
two things measured side by side.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from declattn.api import DEFAULT_PREFILL_CHUNK, Engine
from declattn.bench.attn_micro import MicroConfig, run_micro
from declattn.bench.e2e import E2EConfig, engine_over, kv_heavy_config, random_model, run_e2e
from declattn.bench.hf_compare import run_hf_compare
from declattn.bench.machine import BandwidthProbe, machine_info
from declattn.engine.loader import LoadedModel, load_model
from declattn.engine.registry import resolve_model
from declattn.engine.threads import load_average

PARTS = ("micro", "e2e", "hf")
DEFAULT_CONTEXTS = (4096, 16384, 32768)


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What to run. On a 2-core machine the defaults take minutes, most of them the
    comparison with ``transformers`` (both prefill 16K tokens), which ``hf_contexts=(4096,)``
    shortens the most; in the micro part the torch fallback's arms take the longest."""

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    e2e_contexts: tuple[int, ...] = (16384, 65536)
    smol_e2e_contexts: tuple[int, ...] = (16384,)
    hf_contexts: tuple[int, ...] = (4096, 16384)
    output_tokens: int = 160
    hf_new_tokens: int = 32
    repeats: int = 7
    micro_layers: int = 24
    micro_threads: tuple[int, ...] = (1, 2)
    model: str = "smollm2-135m"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    parts: tuple[str, ...] = PARTS
    quick: bool = False

    @classmethod
    def quick_config(cls, **overrides: Any) -> DecodeBenchConfig:
        """Small sizes for a sanity run (a minute or two): every part, little of each."""
        base = cls(
            contexts=(2048, 4096),
            e2e_contexts=(4096,),
            smol_e2e_contexts=(4096,),
            hf_contexts=(512,),
            output_tokens=40,
            hf_new_tokens=4,
            repeats=2,
            micro_layers=2,
            micro_threads=(1,),
            quick=True,
        )
        return dataclasses.replace(base, **overrides)

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad:
            raise ValueError(f"unknown parts {bad}; choose from {', '.join(PARTS)}")
        if self.output_tokens < 16:
            raise ValueError("output_tokens must be >= 16 (a transcript needs every mode)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def extend_positions(loaded: LoadedModel, positions: int) -> bool:
    """Let the engine run past the model's trained length (speed only: the time of a
    step does not depend on whether the model still makes sense there). Returns whether
    the limit was raised."""
    if loaded.config.max_position_embeddings >= positions:
        return False
    cfg = dataclasses.replace(loaded.config, max_position_embeddings=positions)
    loaded.config = cfg
    loaded.model.config = cfg
    return True


@dataclass
class _Log:
    log: Callable[[str], None] | None
    loads: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)

    def mark(self, part: str, when: str) -> None:
        self.loads.append({"part": part, "when": when, "load_average": load_average()})


def run_decode_bench(
    cfg: DecodeBenchConfig, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run the parts of ``cfg`` and return one JSON-ready result."""
    say = _Log(log)
    result: dict[str, Any] = {"machine": machine_info(), "config": cfg.to_dict()}
    probe = BandwidthProbe()
    loaded: LoadedModel | None = None

    def smol() -> LoadedModel:
        nonlocal loaded
        if loaded is None:
            say(f"loading {cfg.model}")
            loaded = load_model(resolve_model(cfg.model), dtype=torch.bfloat16, device="cpu")
        return loaded

    if "micro" in cfg.parts:
        say.mark("micro", "start")
        micro = MicroConfig(
            contexts=cfg.contexts,
            repeats=cfg.repeats,
            n_layers=cfg.micro_layers,
            threads=cfg.micro_threads,
        )
        result["micro"] = run_micro(micro, probe, say)
        say.mark("micro", "end")
    if "e2e" in cfg.parts:
        say.mark("e2e", "start")
        lm = smol()
        rows = []
        longest = max((*cfg.e2e_contexts, *cfg.smol_e2e_contexts), default=0)
        heavy_cfg = kv_heavy_config(lm.config.vocab_size, longest + cfg.output_tokens + 4096)
        heavy = random_model(heavy_cfg, torch.bfloat16)
        for n in cfg.e2e_contexts:
            e2e = E2EConfig(n, cfg.output_tokens, prefill_chunk=cfg.prefill_chunk)
            rows.append(run_e2e("kv-heavy (random weights)", engine_over(heavy, lm.tokenizer),
                                e2e, say))
        del heavy
        for n in cfg.smol_e2e_contexts:
            extended = extend_positions(lm, n + cfg.output_tokens + 4096)
            e2e = E2EConfig(n, cfg.output_tokens, prefill_chunk=cfg.prefill_chunk)
            row = run_e2e(cfg.model, Engine(lm), e2e, say)
            row["beyond_trained_length"] = extended
            rows.append(row)
        result["e2e"] = {
            "kv_heavy_model": {
                k: getattr(heavy_cfg, k)
                for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
            },
            "runs": rows,
        }
        say.mark("e2e", "end")
    if "hf" in cfg.parts:
        say.mark("hf", "start")
        lm = smol()
        trained = lm.config.max_position_embeddings
        extend_positions(lm, max(cfg.hf_contexts, default=0) + cfg.hf_new_tokens + 16)
        hf = run_hf_compare(lm, cfg.hf_contexts, cfg.hf_new_tokens, cfg.prefill_chunk, say)
        hf["trained_positions"] = trained
        result["hf"] = hf
        say.mark("hf", "end")
    result["load_average"] = say.loads
    result["machine"]["load_average_end"] = load_average()
    return result


def write_result(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    """``decode-<stamp>.json`` and, if matplotlib is present, a PNG beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"decode-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    try:
        from declattn.bench.decode_plot import plot_result
    except ImportError:  # matplotlib is a dependency, but a figure is not worth a crash
        return path, None
    png = out_dir / f"decode-{stamp}.png"
    plot_result(result, png)
    return path, png
