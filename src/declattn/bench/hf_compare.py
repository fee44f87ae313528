"""Our engine against Hugging Face ``transformers`` ``generate`` on the same weights.

Both load the converted safetensors directory our loader writes, in the same dtype, in
the same process and thread count, and get the same prompt tokens. Prefill and decode
are timed apart: ``generate`` gets a logits processor that stamps the clock after each
forward pass (the first stamp ends the prefill), our engine is timed per step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from declattn.api import Engine
from declattn.bench.transcript import repeated_essay
from declattn.engine.controller import Controller
from declattn.engine.loader import LoadedModel
from declattn.engine.sampler import SamplingParams


def prompt_tokens(tokenizer: Any, n: int) -> list[int]:
    """Exactly ``n`` tokens of the planted-fact document."""
    ids = tokenizer.encode(repeated_essay(tokenizer, n + 64), add_special_tokens=False)
    if len(ids) < n:
        ids = (ids * (n // max(1, len(ids)) + 1))[:n]
    return ids[:n]


def _rates(prefill_s: float, gaps: list[float], n_prompt: int) -> dict[str, float]:
    per_token = statistics.median(gaps) if gaps else float("nan")
    mean = sum(gaps) / len(gaps) if gaps else float("nan")
    return {
        "prefill_seconds": prefill_s,
        "prefill_tokens_per_second": n_prompt / prefill_s,
        "decode_seconds_per_token_median": per_token,
        "decode_seconds_per_token_mean": mean,
        "decode_tokens_per_second": 1.0 / mean if gaps else float("nan"),
    }


def ours(loaded: LoadedModel, ids: list[int], new_tokens: int, prefill_chunk: int) -> dict:
    """Plain greedy decoding on the paged engine (no DA: every block is read)."""
    cfg = loaded.config
    total = len(ids) + new_tokens
    eng = Engine(loaded, kv_tokens=total + 32, prefill_chunk=prefill_chunk,
                 kv_disk=False)  # the prefill is timed: never read from disk
    if cfg.max_position_embeddings < total:
        raise ValueError(f"{total} positions exceed the model's {cfg.max_position_embeddings}")
    seq = eng.add(Controller(ids), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    while seq.prefilled < len(ids):
        eng.step()
    prefill = time.perf_counter() - t0
    gaps = []
    while seq.finish_reason is None:
        t = time.perf_counter()
        eng.step()
        gaps.append(time.perf_counter() - t)
    return _rates(prefill, gaps, len(ids)) | {"new_tokens": len(seq.output_ids)}


def load_hf(weights_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(weights_dir), dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


def hf_generate(model: Any, ids: list[int], new_tokens: int) -> dict:
    """Greedy ``generate`` with its default (dynamic) cache, timed per forward pass."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return scores

    clock = Clock()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    s = clock.stamps
    gaps = [b - a for a, b in zip(s, s[1:], strict=False)]
    return _rates(s[0] - t0, gaps, len(ids)) | {"new_tokens": int(out.shape[1] - x.shape[1])}


def run_hf_compare(
    loaded: LoadedModel,
    contexts: tuple[int, ...],
    new_tokens: int,
    prefill_chunk: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both engines at each context, ours first, then ``generate``."""
    if loaded.weights_dir is None:
        raise ValueError("the model has no weights directory for transformers to load")
    dtype = next(loaded.model.parameters()).dtype
    hf = load_hf(loaded.weights_dir, dtype)
    rows = []
    for n in contexts:
        ids = prompt_tokens(loaded.tokenizer, n)
        if log is not None:
            log(f"vs transformers: context {n:,}, ours")
        a = ours(loaded, ids, new_tokens, prefill_chunk)
        if log is not None:
            log(f"vs transformers: context {n:,}, transformers generate")
        b = hf_generate(hf, ids, new_tokens)
        rows.append(
            {
                "context": n,
                "ours": a,
                "transformers": b,
                "decode_speedup": a["decode_tokens_per_second"] / b["decode_tokens_per_second"],
                "prefill_speedup": a["prefill_tokens_per_second"]
                / b["prefill_tokens_per_second"],
            }
        )
    import transformers

    return {
        "model": str(loaded.source.name),
        "weights_dir": str(loaded.weights_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "transformers": transformers.__version__,
        "attn_implementation": "sdpa",
        "new_tokens": new_tokens,
        "contexts": rows,
    }
