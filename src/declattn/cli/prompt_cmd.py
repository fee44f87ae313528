"""``declattn prompt``: how a context is cut into magic chunks and laid out in the prompt."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from declattn.cli.common import add_model_arg, console, read_context, require_question, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prompt", help="show the chunks and layout of a DA prompt")
    add_model_arg(p, "--tokenizer")
    p.add_argument("--context", required=True, help="a text file, or - for standard input")
    p.add_argument("--question", help="the question asked about the context")
    p.add_argument("--target", type=int, default=2048, help="chunk target size in tokens")
    p.add_argument("--cap", type=int, default=2560, help="chunk hard cap in tokens")
    p.add_argument("--sink", type=int, default=16, help="attention-sink tokens, always read")
    p.add_argument("--style", choices=["auto", "tools", "inline"], default="auto")
    p.add_argument("--show-prompt", action="store_true", help="also print the rendered prompt")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def describe(tokenizer: Any, context: str, question: str, args: argparse.Namespace) -> dict:
    from declattn.protocol.prompt import render_prompt
    from declattn.protocol.segment import segment, token_counter

    chunks = segment(context, token_counter(tokenizer), args.target, args.cap)
    rendered = render_prompt(tokenizer, chunks, question, sink=args.sink, style=args.style)
    layout = rendered.layout
    return {
        "style": rendered.style,
        "layout": layout.to_dict(),
        "chunks": [
            {
                "id": c.id,
                "chars": [c.start, c.end],
                "tokens": c.tokens,
                "span": [layout.chunk(c.id).start, layout.chunk(c.id).end],
                "preview": c.text[:60],
            }
            for c in chunks
        ],
        "prompt_text": rendered.text,
    }


def run(args: argparse.Namespace) -> int:
    from declattn.engine.tokenizer import load_tokenizer

    question = require_question(args.question)
    context = read_context(args.context)
    with user_errors():
        tokenizer = load_tokenizer(args.tokenizer)
        info = describe(tokenizer, context, question, args)
    out = console()
    if args.json:
        if not args.show_prompt:
            info.pop("prompt_text")
        print(json.dumps(info, ensure_ascii=False, indent=1))
        return 0
    table = Table(title=f"{len(info['chunks'])} magic chunks")
    for col in ("id", "chars", "tokens", "token span", "starts with"):
        table.add_column(col, justify="right" if col != "starts with" else "left")
    for c in info["chunks"]:
        preview = c["preview"].replace("\n", " ")
        table.add_row(
            str(c["id"]),
            f"{c['chars'][0]}-{c['chars'][1]}",
            str(c["tokens"]),
            f"{c['span'][0]}-{c['span'][1]}",
            preview,
        )
    out.print(table)
    lay = info["layout"]
    kept = lay["sink"][1] - lay["sink"][0] + lay["question"][1] - lay["question"][0]
    out.print(
        f"prompt: {lay['prompt_len']} tokens, style {info['style']}; "
        f"sink {lay['sink'][0]}-{lay['sink'][1]}; "
        f"question window {lay['question'][0]}-{lay['question'][1]}; "
        f"local mode reads {kept} prompt tokens ({kept / lay['prompt_len']:.1%})"
    )
    if args.show_prompt:
        out.rule("rendered prompt")
        out.print(info["prompt_text"], markup=False)
    return 0
