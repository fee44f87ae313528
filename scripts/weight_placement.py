"""How fast one decode row reads a model's GGUF weights from three placements of the same bytes.

- ``arena``: where the engine keeps them (``engine/quant/arena.py``: one anonymous
  mapping, 2 MB pages where the OS allows them);
- ``torch heap``: each matrix a tensor of torch's own allocator (4 KB pages unless the
  OS gives every allocation huge pages);
- ``file views``: the K-format matrices (kept in the file's layout) as views of the
  packed cache file, the others in torch's heap: where they were before the arena.

One decode row through every matrix in the model's order, the three alternated in one
process with a read of a 256 MB buffer before each pass (so the weights start out of
cache, and no dirty lines are left to write back) and the bench's read probe after
each round; the ``K formats`` lines are the Q4_K and Q6_K matrices alone. Usage:
``python scripts/weight_placement.py [--model qwen2.5-0.5b] [--threads 1] [--passes 9]``
(docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from safetensors import safe_open

from declattn.api import Engine
from declattn.bench.machine import BandwidthProbe
from declattn.engine.quant.kernel import gguf_ops
from declattn.engine.quant.linear import GGUFLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    summary = engine.loaded.quant
    named = [(n, m) for n, m in engine.loaded.model.named_modules() if isinstance(m, GGUFLinear)]
    mods = [m for _, m in named]
    kformat = [m.kernel_type == m.ggml_type for m in mods]  # not regrouped: the file's layout
    with safe_open(summary.cache_file, framework="pt", device="cpu") as f:
        views = {n: f.get_tensor(f"{n}.blocks") for n, m in named if m.kernel_type == m.ggml_type}
    placements = {
        "arena": [m.blocks for m in mods],
        "torch heap": [m.blocks.clone() for m in mods],
        "file views": [views.get(n, m.blocks.clone()) for n, m in named],
    }
    for ws in placements.values():
        assert all(torch.equal(w, m.blocks) for w, m in zip(ws, mods, strict=True))
    op = gguf_ops().gguf_linear_cat.default
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {m.in_features for m in mods}}
    passes = {}
    for name, ws in placements.items():
        rows = list(zip(mods, ws, strict=True))
        passes[name] = (rows, sum(w.numel() for w in ws))
        krows = [r for r, k in zip(rows, kformat, strict=True) if k]
        passes[f"{name}, K formats"] = (krows, sum(w.numel() for _, w in krows))
    flush = torch.ones(64 * 2**20)  # 256 MB, read only
    probe = BandwidthProbe()
    probe.sample()
    probe.copies.clear()
    probe.reads.clear()
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(args.passes):
        for name, (rows, _) in passes.items():
            flush.sum()
            t0 = time.perf_counter()
            for m, w in rows:
                op(xs[m.in_features], [w], [m.kernel_type])
            times[name].append(time.perf_counter() - t0)
        probe.sample()
    print(
        f"{args.model}: {len(mods)} matrices, {args.threads} thread(s), arena in huge pages:"
        f" {summary.huge_pages}; best / median of {args.passes}"
    )
    for name, ts in times.items():
        nbytes = passes[name][1]
        best, med = min(ts), statistics.median(ts)
        print(
            f"{name:>22}: {best * 1e3:6.2f} / {med * 1e3:6.2f} ms, {nbytes / 1e6:5.1f} MB, "
            f"{nbytes / best / 1e9:5.2f} / {nbytes / med / 1e9:5.2f} GB/s"
        )
    bw = probe.result()
    print(f"{'probe':>22}: {bw.read_best / 1e9:5.2f} / {bw.read_median / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
