"""A decode step of ``qwen2.5-0.5b-da`` (the adapter merged into the GGUF's own blocks)
against the base ``qwen2.5-0.5b``: the same prompt, the same forced tokens, timed in
alternating blocks so both models share the same minutes of a shared machine.

Merging keeps every matrix's format and size, so the two steps should read the same
bytes through the same kernels; this measures it (docs/training.md quotes it). Usage:
``python scripts/merged_decode_ab.py [--context 16384] [--threads 1] [--blocks 8]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from declattn.api import Engine
from declattn.bench import peers

STEPS = 12
"""Decode steps per timed block."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-0.5b-da")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per model (median)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = peers.PeersConfig(contexts=(args.context,), threads=(args.threads,),
                            repeats=2 * args.blocks * STEPS + STEPS, decode_tokens=1,
                            llama_python=None)
    arms = {}
    for name in args.models.split(","):
        engine = Engine.from_pretrained(name, dtype="auto", device="cpu")
        sessions, tokens, tag_len = peers._prompt(
            engine.tokenizer, engine.max_positions, args.context, cfg)
        for kind, key in (("DA focus", "da"), ("vanilla", "vanilla")):
            arm = peers._declattn_arm(engine, kind, sessions[key], tokens, cfg)
            peers._prefill(arm, synthetic=True, seed=0)
            peers._decode_block(arm, None, tokens[: tag_len + 2], args.threads)
            arms[(name, kind)] = arm
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.blocks):
        for key, arm in arms.items():
            t0 = time.perf_counter()
            for _ in range(STEPS):
                arm.engine.step()
            times.setdefault(key, []).append((time.perf_counter() - t0) / STEPS)
    base = args.models.split(",")[0]
    print(f"{args.context:,}-token context, {args.threads} thread(s): ms per decode step, "
          f"median of {args.blocks} blocks of {STEPS} steps")
    for (name, kind), ts in times.items():
        ms = 1e3 * statistics.median(ts)
        ref = 1e3 * statistics.median(times[(base, kind)])
        print(f"{name:16s} {kind:9s} {ms:7.2f} ms  ({ms / ref:.3f}x {base})")


if __name__ == "__main__":
    main()
