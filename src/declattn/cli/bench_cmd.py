"""``declattn bench``: measurements, never asserted in tests (the machines are shared)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from declattn.cli.common import console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (segmenter, decode attention, end to end)")
    bsub = p.add_subparsers(dest="bench", required=True)
    seg = bsub.add_parser("segment", help="segment a long text (1M tokens by default)")
    seg.add_argument("--tokenizer", default="smollm2-135m")
    seg.add_argument("--tokens", type=int, default=1_000_000)
    seg.add_argument("--json", action="store_true")
    seg.set_defaults(func=run_segment)


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
