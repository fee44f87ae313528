"""``declattn replay``: per-mode attended tokens of a finished response.

The saving it prints is per step: the reply against the same reply read in full. With
``--plain`` (the plain answer's record to the same question) it adds the cost per answer:
the DA reply's counts over the plain reply's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from declattn.cli.answering import print_comparison
from declattn.cli.common import UserError, console, read_context, require_question, user_errors
from declattn.cli.tables import attended_table, declarations_table

if TYPE_CHECKING:
    from declattn.api.results import Stats


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
    p.add_argument("--line-start", action="store_true",
                   help="tags count only at line start (a record keeps its own setting)")
    p.add_argument("--scaffold-local", action="store_true",
                   help="steps that write tag text read as local, as --economy runs (a record "
                   "keeps its own setting)")
    p.add_argument("--plain", metavar="RECORD",
                   help="with a record: the plain answer's record to the same question "
                   "(run --compare --save writes NAME.vanilla.json), for the cost per answer")
    p.add_argument("--focus", choices=["ids", "find", "both"], default=None,
                   help="with --response: the focus form the run's instruction taught")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Transcript:
    """What a replay needs: the prompt's layout, the output token texts, the block size,
    the chunk texts (find resolution) and the request's reading rules."""

    layout: Any
    token_texts: list[str]
    block_size: int
    chunk_texts: list[str] | None
    line_start: bool
    scaffold_local: bool
    record: dict[str, Any] | None = None


def _rule(flag: bool, options: dict[str, Any], name: str) -> bool:
    """A reading rule: the record's own, where it kept its options; a flag that says
    otherwise is an error, not silently overridden."""
    if name not in options:
        return flag
    kept = bool(options[name])
    if flag and not kept:
        raise UserError(f"the record ran with {name}=False: drop --{name.replace('_', '-')}")
    return kept


def _from_record(args: argparse.Namespace) -> Transcript:
    from declattn.protocol.layout import Layout
    from declattn.show.record import load_record

    try:
        rec = load_record(args.record)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    texts = [c["text"] for c in rec.get("chunks", [])] or None
    options = rec.get("options", {})
    return Transcript(
        Layout.from_dict(rec["layout"]), rec["output"]["token_texts"], rec["block_size"],
        texts, _rule(args.line_start, options, "line_start"),
        _rule(args.scaffold_local, options, "scaffold_local"), rec,
    )


def _from_response(args: argparse.Namespace) -> Transcript:
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
    return Transcript(layout, texts, args.block_size, [c.text for c in chunks],
                      args.line_start, args.scaffold_local)


def run(args: argparse.Namespace) -> int:
    from declattn.da.replay import replay

    if args.record and args.response:
        raise UserError("give either a record file or --response, not both")
    if args.plain and not args.record:
        raise UserError("--plain needs a record file (the DA run's record)")
    if args.record:
        t = _from_record(args)
    elif args.response:
        t = _from_response(args)
    else:
        raise UserError("nothing to replay: give a record file or --response FILE")
    result = replay(t.layout, t.token_texts, block_size=t.block_size, line_start=t.line_start,
                    chunk_texts=t.chunk_texts, scaffold_local=t.scaffold_local)
    data = result.to_dict()
    pair = _stats_pair(t.record, args.plain) if t.record is not None and args.plain else None
    if args.json:
        out = {k: data[k] for k in ("totals", "by_mode", "declarations")}
        if pair is not None:
            from declattn.api.results import PerAnswer

            pa = PerAnswer.of(*pair)
            out["per_answer"] = {**dataclasses.asdict(pa), "verdict": pa.verdict()}
        print(json.dumps(out, indent=1))
        return 0
    con = console()
    con.print(attended_table(data["by_mode"], data["totals"],
                             "attended tokens per mode, summed over decode steps"))
    decl = declarations_table(data["declarations"])
    if decl is not None:
        con.print(decl)
    if pair is not None:
        print_comparison(con, *pair)
    return 0


def _stats_pair(record: dict[str, Any], plain: str) -> tuple[Stats, Stats]:
    """The DA record's counts and the plain record's, for the cost per answer."""
    from declattn.show.record import load_plain_stats, stats_of

    try:
        return stats_of(record, "the record"), load_plain_stats(plain)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
