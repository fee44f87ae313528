"""The ``declattn`` command: one sub-command per module in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from declattn.cli import (
    bench_cmd,
    cache_cmd,
    chat_cmd,
    demo_cmd,
    doctor_cmd,
    eval_cmd,
    export_cmd,
    models_cmd,
    prompt_cmd,
    replay_cmd,
    roofline_cmd,
    run_cmd,
    serve_cmd,
    show_cmd,
    train_cmd,
)
from declattn.cli.common import UserError

_COMMANDS = (
    prompt_cmd,
    replay_cmd,
    run_cmd,
    chat_cmd,
    bench_cmd,
    demo_cmd,
    show_cmd,
    models_cmd,
    cache_cmd,
    serve_cmd,
    eval_cmd,
    roofline_cmd,
    train_cmd,
    export_cmd,
    doctor_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="declattn",
        description="Declarative Attention: the model declares what it reads; "
        "the engine reads only that.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"declattn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("declattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
