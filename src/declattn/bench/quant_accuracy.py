"""``declattn bench weights``: what packed weights cost in accuracy, against the file itself.

The reference is the GGUF dequantised to fp32: exactly what the file says. Each prompt is
continued greedily by that reference; every arm is then teacher-forced on the same tokens
and compared position by position: how often its argmax is the reference's token, and its
largest and mean absolute logit error. Arms: bf16 dense weights (today's other path), and
the packed load through each of its two paths: ``decode`` (every row through the integer
kernel, activations rounded to int8 per block as llama.cpp does) and ``prefill`` (rows
through the dequantised weight in an fp32 GEMM). The accuracy test of the packed path
(tests/engine/test_quant_parity.py) asserts on this same measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from declattn.engine.dense import DenseAttention
from declattn.engine.loader import UnsupportedModelError, load_model
from declattn.engine.models import Decoder
from declattn.engine.quant import linear
from declattn.engine.registry import resolve_model

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to French: I like apples.",
    "import numpy as np\n\n# compute the mean of a list",
    "Water boils at",
    "The quick brown fox",
)
ARMS = ("bf16", "packed decode", "packed prefill")


def _logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(len(ids)), DenseAttention()))


def _greedy(model: Decoder, ids: list[int], n: int) -> list[int]:
    attn, out = DenseAttention(), []
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        for i in range(n):
            out.append(int(model.logits(h[-1]).argmax()))
            h = model(torch.tensor([out[-1]]), torch.tensor([len(ids) + i]), attn)
    return out


def measure(model: str, prompts: Sequence[str] = PROMPTS, steps: int = 16) -> dict[str, Any]:
    """Agreement and logit errors of every arm against the fp32 reference."""
    path = resolve_model(model)
    ref = load_model(path, dtype=torch.float32, device="cpu")
    dense = load_model(path, dtype=torch.bfloat16, device="cpu")
    packed = load_model(path, device="cpu")
    if packed.quant is None:
        raise UnsupportedModelError(f"{model}: not a GGUF file, so nothing is packed")
    stats = {a: {"agree": 0, "max_abs": 0.0, "mean_abs": 0.0} for a in ARMS}
    total = 0
    rows_before = linear.GEMM_ROWS
    try:
        for text in prompts:
            ids = ref.tokenizer(text).input_ids
            cont = _greedy(ref.model, ids, steps)
            full = torch.tensor(ids + cont)
            want = _logits(ref.model, full)[len(ids) - 1 : -1]
            for arm in ARMS:
                linear.GEMM_ROWS = 10**9 if arm == "packed decode" else 1
                got = _logits((dense if arm == "bf16" else packed).model, full)
                err = (got[len(ids) - 1 : -1] - want).abs()
                st = stats[arm]
                st["agree"] += int((got[len(ids) - 1 : -1].argmax(-1) == torch.tensor(cont)).sum())
                st["max_abs"] = max(st["max_abs"], float(err.max()))
                st["mean_abs"] += float(err.mean()) * steps
            total += steps
    finally:
        linear.GEMM_ROWS = rows_before
    for st in stats.values():
        st["mean_abs"] /= total
    return {
        "model": model, "positions": total, "prompts": len(prompts), "arms": stats,
        "weights": packed.quant.to_dict(),
        "bytes_per_step": {
            "bf16": dense.model.weight_bytes_per_step(),
            "packed": packed.model.weight_bytes_per_step(),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    n = result["positions"]
    layers = ", ".join(f"{k} x{v}" for k, v in result["weights"]["layers"].items())
    lines = [
        f"{result['model']} ({layers}"
        f"; weights read per step: packed {result['bytes_per_step']['packed'] / 1e6:.0f} MB, "
        f"bf16 {result['bytes_per_step']['bf16'] / 1e6:.0f} MB), {result['prompts']} prompts, "
        f"{n} teacher-forced positions, against the GGUF dequantised to fp32:",
        "",
        "| arm | argmax = reference | max abs logit error | mean abs logit error |",
        "| --- | --- | --- | --- |",
    ]
    for arm, st in result["arms"].items():
        lines.append(f"| {arm} | {st['agree']}/{n} | {st['max_abs']:.2f} | {st['mean_abs']:.3f} |")
    return "\n".join(lines)
