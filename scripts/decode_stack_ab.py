"""A decode step with its layers in one native call against the same step layer by layer.

Builds ``declattn bench peers``' arms (a prompt of about ``--context`` tokens, the KV
filled by the synthetic prefill), then alternates blocks of decode steps with
``DecodeStack.run`` (the default) and with ``PagedAttention.decode_reads`` made to say
``None`` (the runner calls ``before_attention``, the ``AttentionFn`` and
``after_attention`` per layer), for a DA focus step and a vanilla one. Alternation keeps
both ways in the same minutes of a shared machine. Usage:
``python scripts/decode_stack_ab.py [--context 16384] [--threads 1,2] [--blocks 8]``
(docs/engine.md and docs/benchmarks.md quote it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from declattn.api import Engine
from declattn.bench import peers
from declattn.engine.paged import PagedAttention

STEPS = 12
"""Decode steps per timed block."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per way (median)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    per_arm = len(threads) * 2 * args.blocks * STEPS + STEPS  # and a margin
    cfg = peers.PeersConfig(
        model=args.model, contexts=(args.context,), threads=(1,), repeats=per_arm,
        decode_tokens=1, llama_python=None,
    )
    engine = Engine.from_pretrained(cfg.model, dtype="auto", device="cpu")
    sessions, tokens, tag_len = peers._prompt(engine, args.context, cfg)
    arms = {}
    for name, key in (("DA focus", "da"), ("vanilla", "vanilla")):
        arm = peers._declattn_arm(engine, name, sessions[key], tokens, cfg)
        peers._prefill(arm, synthetic=True, seed=0)
        peers._decode_block(arm, None, tokens[: tag_len + 2], 1)  # past the focus tag
        arms[name] = arm
    planned = PagedAttention.decode_reads
    print(f"{args.model}, {len(sessions['da'].prompt_ids):,}-token prompt; ms per step, "
          f"median of {args.blocks} blocks of {STEPS} steps")
    for t in threads:
        torch.set_num_threads(t)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.blocks):
            for way in ("one call", "layer by layer"):
                PagedAttention.decode_reads = (  # type: ignore[method-assign]
                    planned if way == "one call" else (lambda self, windows: None)
                )
                for name, arm in arms.items():
                    t0 = time.perf_counter()
                    for _ in range(STEPS):
                        arm.engine.step()
                    times.setdefault((name, way), []).append((time.perf_counter() - t0) / STEPS)
        PagedAttention.decode_reads = planned  # type: ignore[method-assign]
        for name in arms:
            one, layers = (1e3 * statistics.median(times[(name, w)])
                           for w in ("one call", "layer by layer"))
            print(f"threads {t} {name:9s} one call {one:6.2f}  layer by layer {layers:6.2f}  "
                  f"({layers - one:+.2f} ms)")


if __name__ == "__main__":
    main()
