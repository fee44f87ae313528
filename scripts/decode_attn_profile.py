"""Time of the fused decode-attention kernel alone, per layer call, by view and threads.

qwen2.5-0.5b's shape (14 query heads over 2 KV heads of 64, bf16 KV): 24 layers of random
K/V (so one layer's KV is not in cache when it is read), one decode row, a full view and
a focus-like view of 8 runs keeping 1/8 of the rows; the best of 5 passes, and the bytes
per second that makes. bf16 queries take the AVX-512 BF16 path where the build has it,
fp32 queries the portable path over the same pool (``--queries bf16,fp32`` times both,
alternated in one process); ``--scoring machine,vdpbf16ps,fma,amx`` times the BF16 path's
ways of scoring keys side by side (``machine``: the one this CPU gets). ``--layers 1``:
one layer read again and again, so its rows sit in cache (what the arithmetic costs
without the memory). Usage:
``python scripts/decode_attn_profile.py [--rows 4000,16000] [--threads 1,2] [--queries bf16]
[--scoring machine] [--layers 24]`` (docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import time

import torch

from declattn.engine.decode import MIN_SPLIT_ROWS
from declattn.engine.native import SCORINGS, decode_bf16_path, decode_op, decode_scoring

LAYERS, KV_HEADS, HEADS, DIM = 24, 2, 14, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4000,16000")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--queries", default="bf16", help="query dtypes: bf16, fp32 or both")
    ap.add_argument("--scoring", default="machine", help=f"of {', '.join(SCORINGS)}")
    ap.add_argument("--layers", type=int, default=LAYERS, help="distinct layers (1: in cache)")
    args = ap.parse_args()
    if args.layers < 1 or LAYERS % args.layers:
        ap.error(f"--layers must divide {LAYERS}")
    op = decode_op()
    if op is None:
        raise SystemExit("the decode kernel is not available (see the warning)")
    print(f"AVX-512 BF16 path in this build: {decode_bf16_path()}, scoring by "
          f"{decode_scoring() or '-'} on this CPU")
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(1, HEADS, DIM, generator=g)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    arms = {  # (queries, scoring) by name; fp32 queries never reach the BF16 path
        f"{q} queries" + (f", {sc}" if q == "bf16" else ""): (q32.to(dtypes[q]), SCORINGS[sc])
        for q in args.queries.split(",") for sc in args.scoring.split(",")
    }
    for rows in (int(r) for r in args.rows.split(",")):
        shape = (KV_HEADS, rows, DIM)
        ks = [torch.randn(shape, generator=g).bfloat16() for _ in range(args.layers)]
        vs = [torch.randn(shape, generator=g).bfloat16() for _ in range(args.layers)]
        ks, vs = ks * (LAYERS // args.layers), vs * (LAYERS // args.layers)
        views = {
            "full": torch.tensor([[0, rows]]),
            "focus": torch.tensor([[i * rows // 8, i * rows // 8 + rows // 64] for i in range(8)]),
        }
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name, runs in views.items():
                offsets = torch.tensor([0, runs.shape[0]])
                best = dict.fromkeys(arms, float("inf"))
                for _ in range(6):  # the first pass warms up
                    for arm, (q, scoring) in arms.items():
                        t0 = time.perf_counter()
                        for k, v in zip(ks, vs, strict=True):
                            op(q, k, v, runs, offsets, DIM**-0.5, MIN_SPLIT_ROWS, scoring)
                        best[arm] = min(best[arm], time.perf_counter() - t0)
                kept = int((runs[:, 1] - runs[:, 0]).sum())
                nbytes = kept * KV_HEADS * DIM * 2 * 2 * LAYERS
                for arm, t in best.items():
                    print(f"{rows:>6} rows {name:>5} {arm}, {threads} thread(s): "
                          f"{t / LAYERS * 1e6:7.1f} us per layer, {nbytes / t / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
