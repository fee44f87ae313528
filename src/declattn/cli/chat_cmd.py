"""``declattn chat``: a conversation over one document, one question per line.

The document is prefilled once: each turn's prompt extends the last one (the earlier
questions and replies stay in it, read in every mode), so the prefix cache reuses all
but the newest turn. Questions come from standard input, one per line; an empty line or
end of input ends the conversation, ``/new`` starts a fresh one over the same document.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from declattn.cli.common import (
    UserError,
    add_focus_args,
    add_kv_cache_args,
    add_model_arg,
    console,
    focus_options,
    kv_cache_kwargs,
    read_context,
    user_errors,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="a conversation over one document (questions on stdin)")
    add_model_arg(p)
    p.add_argument("--context", required=True, help="a text file (not -: stdin asks)")
    arm = p.add_mutually_exclusive_group()
    arm.add_argument("--vanilla", action="store_true", help="ordinary prompt, full attention")
    arm.add_argument("--no-mask", action="store_true", help="DA prompt without masking (DA-nm)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: one per core measured idle at the start)")
    add_focus_args(p)
    add_kv_cache_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.cli.answering import per_step_line, stream_arm, timing_line
    from declattn.engine.threads import use_threads

    if args.context == "-":
        raise UserError("--context must be a file: standard input carries the questions")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    threads = use_threads(args.threads)
    context = read_context(args.context)
    out = console()
    out.print(f"[dim]{threads.line()}[/]")
    arm = "vanilla" if args.vanilla else "da-nm" if args.no_mask else "da"
    ns = argparse.Namespace(max_tokens=args.max_tokens, json=False)
    interactive = sys.stdin.isatty()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model, **kv_cache_kwargs(args))
        chat = engine.open(context, focus_options(engine.da_defaults, args)).chat()
        turn = 0
        while True:
            line = _ask(interactive)
            if line is None or not line.strip():
                return 0
            if line.strip() == "/new":
                chat = chat.document.chat()
                out.print("[dim](a new conversation over the same document)[/]")
                continue
            turn += 1
            answer = stream_arm(chat, arm, line.strip(), ns, out)
            s = answer.stats
            out.print(f"[bold]answer {turn}:[/] {answer.answer}")
            out.print(f"[dim]{timing_line(s)}; {per_step_line(s)}[/]")


def _ask(interactive: bool) -> str | None:
    try:
        return input("question> ") if interactive else sys.stdin.readline() or None
    except EOFError:
        return None
