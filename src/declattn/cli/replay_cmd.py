"""``declattn replay``: per-mode attended tokens of a finished response."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from declattn.cli.common import UserError, console, read_context, require_question, user_errors
from declattn.cli.tables import attended_table, declarations_table


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="attended-token table of a saved response",
        description="Replay a run record (from `declattn run --save`), or a response text "
        "file against the prompt built from --tokenizer/--context/--question.",
    )
    p.add_argument("record", nargs="?", help="a run record JSON file")
    p.add_argument("--tokenizer", help="with --response: model name or path for the tokenizer")
    p.add_argument("--context", help="with --response: the context file")
    p.add_argument("--question", help="with --response: the question")
    p.add_argument("--response", help="a text file holding the model's response")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--line-start", action="store_true", help="tags count only at line start")
    p.add_argument("--focus", choices=["ids", "find", "both"], default=None,
                   help="with --response: the focus form the run's instruction taught")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _from_record(path: str) -> tuple[Any, list[str], int]:
    from declattn.protocol.layout import Layout
    from declattn.show.record import load_record

    try:
        rec = load_record(path)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    texts = [c["text"] for c in rec.get("chunks", [])] or None
    layout = Layout.from_dict(rec["layout"])
    return layout, rec["output"]["token_texts"], rec["block_size"], texts


def _from_response(args: argparse.Namespace) -> tuple[Any, list[str], int]:
    from declattn.da.options import DAOptions
    from declattn.engine.detok import Detokenizer
    from declattn.engine.tokenizer import load_tokenizer
    from declattn.protocol.prompt import render_prompt
    from declattn.protocol.segment import segment, token_counter
    from declattn.protocol.template import encode_user_text

    for flag in ("tokenizer", "context"):
        if not getattr(args, flag):
            raise UserError(f"--response needs --{flag}")
    question = require_question(args.question)
    context = read_context(args.context)
    resp = Path(args.response)
    if not resp.is_file():
        raise UserError(f"response file not found: {args.response}")
    with user_errors():
        tok = load_tokenizer(args.tokenizer)
        chunks = segment(context, token_counter(tok))
        instruction = DAOptions(focus=args.focus or "ids").instruction_for(chunks, tok)
        layout = render_prompt(tok, chunks, question, instruction=instruction).layout
    detok = Detokenizer(tok)
    texts = [detok.add(t) for t in encode_user_text(tok, resp.read_text(encoding="utf-8"))]
    if texts:
        texts[-1] += detok.flush()
    return layout, texts, args.block_size, [c.text for c in chunks]


def run(args: argparse.Namespace) -> int:
    from declattn.da.replay import replay

    if args.record and args.response:
        raise UserError("give either a record file or --response, not both")
    if args.record:
        layout, texts, block_size, chunk_texts = _from_record(args.record)
    elif args.response:
        layout, texts, block_size, chunk_texts = _from_response(args)
    else:
        raise UserError("nothing to replay: give a record file or --response FILE")
    result = replay(layout, texts, block_size=block_size, line_start=args.line_start,
                    chunk_texts=chunk_texts)
    data = result.to_dict()
    if args.json:
        print(json.dumps({k: data[k] for k in ("totals", "by_mode", "declarations")}, indent=1))
        return 0
    out = console()
    out.print(attended_table(data["by_mode"], data["totals"], "attended tokens per mode"))
    decl = declarations_table(data["declarations"])
    if decl is not None:
        out.print(decl)
    return 0
