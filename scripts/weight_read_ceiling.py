"""How fast one decode row's weights can be read here, against how fast the GGUF kernel reads them.

Three passes over every GGUF matrix of a model, in the model's order (as a decode step
reads them), interleaved with the bench's read-bandwidth probe so that all four see the
same minutes and neighbours:

- ``kernel``: one decode row through each matrix (``GGUFLinear``, the real path);
- ``same pattern``: the same bytes loaded in the kernel's order (groups of rows side by
  side, software prefetch, the same tiles over the threads) and nothing computed;
- ``row by row``: the same bytes loaded one row after another (one stream per thread);
- ``probe``: torch's sum of one 256 MB buffer (``declattn.bench.machine.BandwidthProbe``,
  the figure bench peers divides by).

If ``kernel`` ~ ``same pattern``, arithmetic is not what bounds the weights; if ``same
pattern`` is slower than ``row by row``, the access pattern is. Usage:
``python scripts/weight_read_ceiling.py [--model qwen2.5-0.5b] [--threads 1] [--passes 7]
[--by-kind]`` (docs/benchmarks.md quotes it; ``--by-kind`` adds kernel against row by row
per layout and shape).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from declattn.api import Engine
from declattn.bench.machine import BandwidthProbe
from declattn.engine.native import build_library
from declattn.engine.quant.kernel import REGROUPED
from declattn.engine.quant.linear import GGUFLinear

SOURCE = Path(__file__).with_name("csrc") / "read_ceiling.cpp"
SIDE_BY_SIDE = {2: 8, 3: 8, 6: 8, 8: 4, 12: 1, 14: 1} | dict.fromkeys(REGROUPED, 1)
"""Rows the kernel reads side by side per layout it is given (``kernel_type``: ``rows`` in
gguf_dot_avx2.h's block structs; the K formats go one row at a time, and Q5_0 and Q8_0
regrouped by eight or sixteen rows are one run of memory a group)."""


def block_bytes(ggml_type: int) -> int:
    """Bytes per block of a ggml type, as gguf-py gives them."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--by-kind", action="store_true",
                    help="also kernel against row by row per layout and shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_library(SOURCE)))
    touch = torch.ops.declattn_read.touch
    engine = Engine.from_pretrained(args.model)
    mods = [m for m in engine.loaded.model.modules() if isinstance(m, GGUFLinear)]
    nbytes = sum(m.blocks.numel() for m in mods)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {m.in_features for m in mods}}
    passes = {
        "kernel": lambda: [m(xs[m.in_features]) for m in mods],
        "same pattern": lambda: [
            touch(m.blocks, block_bytes(m.ggml_type), SIDE_BY_SIDE[m.kernel_type]) for m in mods
        ],
        "row by row": lambda: [touch(m.blocks, block_bytes(m.ggml_type), 1) for m in mods],
    }
    probe = BandwidthProbe()
    probe.sample()  # first touch of the probe's pages is not bandwidth
    probe.copies.clear()
    probe.reads.clear()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for fn in passes.values():
        fn()  # warm: kernels built, code paged in
    for _ in range(args.passes):
        for name, fn in passes.items():
            probe.flush()  # every pass starts with the weights out of cache
            times[name].append(timed(fn))
        probe.sample()
    print(
        f"{args.model}: {len(mods)} matrices, {nbytes / 1e6:.1f} MB, {args.threads} thread(s),"
        f" best / median of {args.passes}"
    )
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        print(
            f"{name:>13}: {best * 1e3:6.1f} / {med * 1e3:6.1f} ms, "
            f"{nbytes / best / 1e9:5.2f} / {nbytes / med / 1e9:5.2f} GB/s"
        )
    bw = probe.result()
    print(
        f"{'probe':>13}: {bw.read_best / 1e9:5.2f} / {bw.read_median / 1e9:5.2f} GB/s "
        f"(torch sum of {bw.buffer_bytes / 2**20:.0f} MB)"
    )
    if args.by_kind:
        by_kind(mods, xs, touch, probe, args.passes)


def by_kind(mods: list[GGUFLinear], xs, touch, probe: BandwidthProbe, passes: int) -> None:
    """Per layout and shape (the model's matrices of that kind in its order, caches
    flushed first): the kernel against loading the same bytes row by row, best of
    ``passes``. Which formats the arithmetic, not the bytes, holds back."""
    kinds: dict[tuple[int, int, int], list[GGUFLinear]] = {}
    for m in mods:
        kinds.setdefault((m.kernel_type, m.out_features, m.in_features), []).append(m)
    for (layout, rows, cols), group in kinds.items():
        nbytes = sum(m.blocks.numel() for m in group)
        arms = {
            "kernel": lambda g=group: [m(xs[m.in_features]) for m in g],
            "row by row": lambda g=group: [touch(m.blocks, block_bytes(m.ggml_type), 1) for m in g],
        }
        best = dict.fromkeys(arms, float("inf"))
        for _ in range(passes):
            for name, fn in arms.items():
                probe.flush()
                best[name] = min(best[name], timed(fn))
        print(f"layout {layout} {rows}x{cols} x{len(group)} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{name} {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s)" for name, t in best.items()))


if __name__ == "__main__":
    main()
