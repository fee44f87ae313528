"""Time of one RMSNorm and one RoPE call at decode size, native kernel against torch ops.

qwen2.5-0.5b's shapes (one token: hidden 896; 14 query heads of 64), bf16, one thread,
best of 5 x 2,000 calls through the model's own blocks (``RMSNorm``, ``apply_rotary``),
with the kernel (``engine/models/fused.py``) and with the torch code it replaces. Usage:
``python scripts/norm_rope_profile.py`` (docs/engine.md quotes it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from unittest import mock

import torch

from declattn.engine.models import fused
from declattn.engine.models.layers import RMSNorm, apply_rotary


def best_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    if fused.layer_ops() is None:
        raise SystemExit("the layer kernel is not available (see the warning)")
    norm = RMSNorm(896, 1e-6).to(torch.bfloat16)
    x = torch.randn(1, 896).to(torch.bfloat16)
    q = torch.randn(1, 14, 64).to(torch.bfloat16)
    cos, sin = torch.randn(1, 32), torch.randn(1, 32)
    calls = {"RMSNorm": lambda: norm(x), "RoPE": lambda: apply_rotary(q, cos, sin)}
    with torch.inference_mode():
        for name, fn in calls.items():
            native = best_us(fn)
            with (
                mock.patch.object(fused, "rms_norm", lambda *a: None),
                mock.patch.object(fused, "rotary", lambda *a: None),
            ):
                ops = best_us(fn)
            print(f"{name:>8}: native {native:5.1f} us, torch ops {ops:5.1f} us per call")


if __name__ == "__main__":
    main()
