"""``declattn bench``: measurements, never asserted in tests (the machines are shared)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from declattn.cli.common import UserError, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (segmenter, decode attention, end to end)")
    bsub = p.add_subparsers(dest="bench", required=True)
    seg = bsub.add_parser("segment", help="segment a long text (1M tokens by default)")
    seg.add_argument("--tokenizer", default="smollm2-135m")
    seg.add_argument("--tokens", type=int, default=1_000_000)
    seg.add_argument("--json", action="store_true")
    seg.set_defaults(func=run_segment)
    dec = bsub.add_parser(
        "decode",
        help="decode speed: attention per mode vs bytes read, DA vs vanilla end to end, "
        "and against transformers",
    )
    dec.add_argument("--contexts", type=_ints, default=None,
                     help="micro-benchmark contexts, comma separated (default 4096..131072)")
    dec.add_argument("--e2e-contexts", type=_ints, default=None,
                     help="end-to-end contexts for the KV-heavy model (default 16384,65536)")
    dec.add_argument("--smol-e2e-contexts", type=_ints, default=None,
                     help="end-to-end contexts for SmolLM2 (default 16384)")
    dec.add_argument("--hf-contexts", type=_ints, default=None,
                     help="contexts for the transformers comparison (default 4096,16384)")
    dec.add_argument("--output-tokens", type=int, default=None,
                     help="tokens in the forced transcript (default 160)")
    dec.add_argument("--repeats", type=int, default=None, help="micro-benchmark repeats")
    dec.add_argument("--parts", default="micro,e2e,hf",
                     help="which parts to run, comma separated (micro, e2e, hf)")
    dec.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: one per core the load average leaves idle)")
    dec.add_argument("--quick", action="store_true", help="small sizes: a sanity run")
    dec.add_argument("--out", default="out/bench", help="directory for the JSON and PNG")
    dec.set_defaults(func=run_decode)
    vl = bsub.add_parser(
        "vllm", help="decode time on vLLM (CPU build) with the DA plugin, DA vs DA-nm"
    )
    vl.add_argument("--model", default="smollm2-135m")
    vl.add_argument("--context-tokens", type=int, default=None,
                    help="document tokens (default 7000: SmolLM2 has 8,192 positions)")
    vl.add_argument("--output-tokens", type=int, default=None,
                    help="tokens in the forced transcript")
    vl.add_argument("--repeats", type=int, default=None, help="runs per arm, alternating")
    vl.add_argument("--json", action="store_true")
    vl.add_argument("--out", default="out/bench", help="directory for the JSON")
    vl.set_defaults(func=run_vllm)


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers; an empty string is none (skips that run)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from e
    if values and min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def run_segment(args: argparse.Namespace) -> int:
    from declattn.bench.segment import bench_segment
    from declattn.engine.tokenizer import load_tokenizer

    with user_errors():
        tok = load_tokenizer(args.tokenizer)
    result = bench_segment(tok, n_tokens=args.tokens)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        console().print(
            f"segmented {result['tokens']:,} tokens ({result['chars']:,} chars) into "
            f"{result['chunks']} chunks in {result['seconds']:.2f} s "
            f"({result['tokens_per_second']:,.0f} tokens/s)"
        )
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.bench.decode import DecodeBenchConfig, run_decode_bench, write_result
    from declattn.bench.decode_report import machine_line, tables
    from declattn.engine.threads import use_threads

    threads = use_threads(args.threads)
    overrides = {
        "contexts": args.contexts,
        "e2e_contexts": args.e2e_contexts,
        "smol_e2e_contexts": args.smol_e2e_contexts,
        "hf_contexts": args.hf_contexts,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
        "parts": tuple(p.strip() for p in args.parts.split(",") if p.strip()),
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = (
            DecodeBenchConfig.quick_config(**overrides)
            if args.quick
            else DecodeBenchConfig(**overrides)
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    out = console()
    err = console(stderr=True)
    err.print(f"torch threads: {threads}")
    with user_errors():
        result = run_decode_bench(cfg, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    path, png = write_result(result, Path(args.out))
    out.print(machine_line(result))
    for table in tables(result):
        out.print(table)
    out.print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.bench.vllm_decode import VllmBenchConfig, run_vllm_bench, write_result

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError("bench vllm needs vLLM in this environment (docs/vllm.md)") from e
    overrides = {
        "model": args.model,
        "context_tokens": args.context_tokens,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
    }
    try:
        cfg = VllmBenchConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise UserError(str(e)) from e
    err = console(stderr=True)
    with user_errors():
        result = run_vllm_bench(cfg, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    path = write_result(result, Path(args.out))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    console().print(
        f"vLLM decode, {result['prompt_tokens']:,}-token prompt, {result['output_tokens']} "
        f"forced tokens: DA {result['da_decode_seconds']:.2f} s, DA-nm "
        f"{result['vanilla_decode_seconds']:.2f} s, ratio {result['ratio']:.2f}x "
        f"(median step {result['ratio_median_step']:.2f}x; blocks read "
        f"{result['blocks_ratio']:.2f}x); {result['machine']}, {result['date']}\nwrote {path}"
    )
    return 0
