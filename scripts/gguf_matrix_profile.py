"""Time of one decode row through every GGUF matrix of a model, by kind and format.

For each kind of matrix (``gate_proj`` in Q5_0, the output head in Q8_0, ...): the best
of 5 passes over all matrices of that kind (so the weights do not sit in cache), their
bytes, and the bytes per second the GGUF kernel reached. ``--rows 8``: a batch of eight
decode rows (a server step with eight sequences), where each tile of weight rows is read
from memory once and from cache seven more times. Usage:
``python scripts/gguf_matrix_profile.py [--model qwen2.5-0.5b] [--threads 1] [--rows 1]``
(docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from declattn.api import Engine
from declattn.engine.quant.kernel import NATIVE_TYPES
from declattn.engine.quant.linear import GGUFLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1, help="decode rows per call (batch)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    kinds: dict[tuple, list[GGUFLinear]] = collections.defaultdict(list)
    for name, m in engine.loaded.model.named_modules():
        if isinstance(m, GGUFLinear):
            fmt = NATIVE_TYPES.get(m.ggml_type, str(m.ggml_type))
            kinds[(name.split(".")[-1], fmt, m.out_features, m.in_features)].append(m)
    total = 0.0
    for key, mods in sorted(kinds.items(), key=lambda kv: -sum(m.blocks.numel() for m in kv[1])):
        x = torch.randn(args.rows, key[3], dtype=torch.bfloat16)
        for m in mods:
            m(x)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for m in mods:
                m(x)
            best = min(best, time.perf_counter() - t0)
        nbytes = sum(m.blocks.numel() * m.blocks.element_size() for m in mods)
        total += best
        print(f"{key[0]:>12} {key[1]:>5} {key[2]}x{key[3]} x{len(mods):>2}: {best * 1e3:7.2f} ms,"
              f" {nbytes / 1e6:6.1f} MB, {nbytes / best / 1e9:5.2f} GB/s")
    print(f"all matrices: {total * 1e3:.1f} ms per call of {args.rows} decode row(s)")


if __name__ == "__main__":
    main()
