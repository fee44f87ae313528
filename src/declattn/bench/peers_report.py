"""``declattn bench peers``: its options, its table, its files (the run is ``peers.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from declattn.bench.peers import PeersConfig, run_peers


def add_arguments(p: Any, ints: Any) -> None:
    """The sub-command's options; ``ints`` parses a comma list of positive integers."""
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shipped GGUF model or a path")
    p.add_argument("--compare", default="",
                   help="comma list of other models with --model's tokenizer whose declattn "
                   "arms run in the same interleaved repeats (e.g. qwen2.5-0.5b-da)")
    p.add_argument("--contexts", type=ints, default=(4096, 16384, 32768))
    p.add_argument("--threads", type=ints, default=(1, 2))
    p.add_argument("--prefill-threads", type=ints, default=None,
                   help="thread counts prefill is timed at (default: every --threads)")
    p.add_argument("--repeats", type=int, default=3, help="decode blocks per arm (median)")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens per decode block")
    p.add_argument("--focus-share", type=float, default=0.125,
                   help="share of the context one chunk holds (DA focuses on one)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="declattn's weights: auto (the GGUF's own blocks) or dense")
    p.add_argument("--flash-attn", default="on,off", help="llama.cpp arms: on, off or on,off")
    p.add_argument("--llama-python", default=".venv-bench/bin/python",
                   help="python of the bench environment (make bench-env); 'none' skips "
                   "llama.cpp")
    p.add_argument("--out", default="out/bench", help="directory for peers.json and .md")


def config(args: argparse.Namespace) -> PeersConfig:
    fa = tuple({"on": True, "off": False}[x.strip()] for x in args.flash_attn.split(","))
    return PeersConfig(
        model=args.model, compare=tuple(m.strip() for m in args.compare.split(",") if m.strip()),
        contexts=tuple(args.contexts), threads=tuple(args.threads),
        prefill_threads=tuple(args.prefill_threads) if args.prefill_threads else None,
        repeats=args.repeats, decode_tokens=args.decode_tokens, focus_share=args.focus_share,
        dtype=args.dtype, flash_attn=fa,
        llama_python=None if args.llama_python == "none" else args.llama_python,
    )


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(result: dict[str, Any]) -> str:
    """One table per context: every arm at every thread count, and the ratios that the
    goals are stated in (declattn over llama.cpp's best of flash attention on/off)."""
    m = result["machine"]
    load = result["load_average"]
    lines = [
        f"`{result['command']}`",
        "",
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}; load average "
        f"{_f(load['start'], '.1f')} at start, {_f(load['end'], '.1f')} at end. "
        f"llama-cpp-python {(result['llama_cpp'] or {}).get('version', '-')}.",
        "",
    ]
    for ctx in result["contexts"]:
        lines += [
            f"**{ctx['prompt_tokens']:,}-token prompt** ({ctx['chunks']} chunks; DA focus reads "
            f"{ctx['da_kv_kept_share']:.0%} of vanilla's KV bytes)",
            "",
            "| arm | threads | prefill tok/s | decode ms/token | x llama.cpp best | "
            "bytes/step (weights + KV) | effective GB/s | % of read bandwidth |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        best = {}
        for row in ctx["rows"]:
            if row["arm"].startswith("llama.cpp"):
                t = row["threads"]
                best[t] = min(best.get(t, float("inf")), row["decode_ms"])
        for row in ctx["rows"]:
            ratio = row["decode_ms"] / best[row["threads"]] if row["threads"] in best else None
            total = row["weight_bytes"] + row["kv_bytes"]
            lines.append(
                f"| {row['arm']} | {row['threads']} | {_f(row['prefill_tok_s'], '.0f')} | "
                f"{row['decode_ms']:.1f} | {_f(ratio, '.2f')} | {total / 1e6:.0f} MB "
                f"({row['weight_bytes'] / 1e6:.0f} + {row['kv_bytes'] / 1e6:.0f}) | "
                f"{row['effective_gb_s']:.1f} | "
                f"{100 * row['effective_gb_s'] / row['bandwidth_read_best_gb_s']:.0f}% of "
                f"{row['bandwidth_read_best_gb_s']:.1f} |"
            )
        lines.append("")
        for arm, kinds in ctx.get("profile_ms", {}).items():
            total = sum(kinds.values())
            parts = ", ".join(f"{k} {ms:.1f} ms ({ms / total:.0%})" for k, ms in kinds.items())
            lines.append(f"profile of a {arm} step ({total:.1f} ms, torch profiler): {parts}")
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = config(args)
    try:
        result = run_peers(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"declattn bench peers: {e}", file=sys.stderr)
        return 2
    result["command"] = shlex.join(["declattn", *sys.argv[1:]])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = markdown(result)
    (out / "peers.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'peers.json'} and {out / 'peers.md'}")
    return 0
