"""Answering on the terminal: stream one arm's response coloured by mode, then report
what it read. ``declattn run`` and ``declattn demo`` both show answers this way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from declattn.cli.tables import MODE_STYLES, attended_table, declarations_table

if TYPE_CHECKING:
    from declattn.api import Answer, Chat, Document, Stats


def stream_arm(doc: Document | Chat, arm: str, question: str, args: Any, out: Any) -> Answer:
    """Answer ``question`` over ``doc`` (a document, or a conversation over one) as ``arm``
    (da, da-nm, vanilla), streaming the text coloured by mode (unless ``args.json``);
    prefill progress on a bar."""
    results: list[Answer] = []
    with Progress(
        TextColumn(f"[bold]{arm}[/] prefill"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens"),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    ) as progress:
        task = progress.add_task("prefill", total=None)

        def on_prefill(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        stream = doc.generate(
            question,
            da=arm != "vanilla",
            masking=arm != "da-nm",
            max_tokens=args.max_tokens,
            on_prefill=on_prefill,
            result=results,
        )
        first = next(stream)
    if not args.json:
        out.rule(f"{arm} response")
    for delta in [first, *stream]:
        if args.json:
            continue
        style = MODE_STYLES.get(delta.mode, "")
        out.print(delta.text, style=style, end="", markup=False, soft_wrap=True)
    if not args.json:
        out.print()
    answer = results[0]
    if answer.note is not None:  # DA asked, vanilla run: say so, never silently
        out.print(f"[yellow]note: {answer.note} (--min-context 0 runs DA anyway)[/]")
    return answer


def kv_sources(s: Stats) -> str:
    """Where the prompt's KV came from: the prefix cache in memory, its disk tier, or
    computed by the prefill (parts that are zero left out)."""
    parts = [
        (s.cached_tokens - s.disk_tokens, "from memory"),
        (s.disk_tokens, "from disk"),
        (s.prompt_tokens - s.cached_tokens, "computed"),
    ]
    return ", ".join(f"{n:,} {where}" for n, where in parts if n)


def timing_line(s: Stats) -> str:
    """Prompt, reuse and timing of one answer, on one line."""
    reused = f" (KV: {kv_sources(s)})" if s.cached_tokens else ""
    return (
        f"prompt {s.prompt_tokens:,} tokens{reused}; {s.output_tokens} generated; "
        f"prefill {s.prefill_seconds:.1f} s; decode {s.decode_seconds:.1f} s "
        f"({1000 * s.decode_seconds / max(1, s.decode_steps):.0f} ms/step); "
        f"KV read {s.bytes_read / 1e9:.2f} GB"
    )


def record_paths(save: str | None, arms: Sequence[str]) -> dict[str, str]:
    """Where each arm's run record goes: ``save`` itself for one arm, ``NAME.ARM.json``
    for several (``run --compare --save run.json``: run.da.json, run.vanilla.json)."""
    if not save:
        return {}
    if len(arms) == 1:
        return {arms[0]: save}
    return {arm: suffixed(save, arm) for arm in arms}


def report_answers(
    answers: dict[str, Answer],
    args: Any,
    out: Any,
    question: str,
    paths: Mapping[str, str] | None = None,
    evidence: list[int] | None = None,
) -> None:
    """Save the run records (``paths``: arm -> file, see ``record_paths``) and print each
    arm's answer, attended-token table, declarations and timing; with a DA and a plain
    (vanilla) answer, the two comparisons last. ``evidence``: the chunks holding what the
    question needs, when known (the records then say whether each focus held it)."""
    from declattn.show.record import build_record, save_record

    paths = paths or {}
    records = {
        arm: build_record(a, model=args.model, question=question, evidence=evidence)
        for arm, a in answers.items()
    }
    for arm, path in paths.items():
        save_record(records[arm], path)
    if args.json:
        return
    for arm, a in answers.items():
        rec = records[arm]
        out.print(
            f"[bold]{arm} answer:[/] {a.answer if a.answer is not None else '(no <answer> block)'}"
            f"  [dim](finish: {a.finish_reason})[/]"
        )
        out.print(
            attended_table(
                rec["by_mode"], rec["totals"], f"{arm}: attended tokens, summed over decode steps"
            )
        )
        decl = declarations_table(rec["declarations"])
        if decl is not None:
            out.print(decl)
        out.print(timing_line(a.stats))
    if "da" in answers and "vanilla" in answers:
        print_comparison(out, answers["da"].stats, answers["vanilla"].stats)
    for path in paths.values():
        out.print(f"run record: {path}")


def suffixed(path: str, tag: str) -> str:
    """``run.json`` -> ``run.TAG.json``: one file per arm or per question."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{tag}.{ext}" if dot else f"{path}.{tag}"


def per_answer_table(a: Stats, b: Stats) -> Table:
    """Per answer: DA's whole reply (``a``) against the plain reply to the same question
    (``b``), what a user pays: each figure and its ratio (``PerAnswer``)."""
    from declattn.api.results import PerAnswer

    r = PerAnswer.of(a, b)
    t = Table(title="per answer: DA reply vs plain reply (same question, same engine)")
    for col in ("", "DA", "plain", "DA / plain"):
        t.add_column(col, justify="right")
    rows = [
        ("reply tokens", a.output_tokens, b.output_tokens, r.tokens),
        ("forwards (decode model calls)", a.decode_steps, b.decode_steps, r.forwards),
        ("attended tokens", a.logical_attended, b.logical_attended, r.attended),
        ("KV bytes read", a.bytes_read, b.bytes_read, r.kv_bytes),
        ("decode seconds", a.decode_seconds, b.decode_seconds, r.seconds),
    ]
    for name, x, y, ratio in rows:
        fx = f"{x:.2f}" if isinstance(x, float) else f"{x:,}"
        fy = f"{y:.2f}" if isinstance(y, float) else f"{y:,}"
        t.add_row(name, fx, fy, f"{ratio:.2f}x")
    return t


def per_step_line(stats: Stats) -> str:
    """The saving per step: a reply against the same reply read in full (DA vs DA-nm)."""
    return (
        f"per step (vs the same reply read in full): {stats.saving:.1%} of attended tokens "
        f"saved ({stats.physical_saving:.1%} of KV blocks)"
    )


def print_comparison(out: Any, da: Stats, plain: Stats) -> None:
    """Both comparisons, named: per answer (DA's reply against the plain reply), then per
    step (against the same reply read in full), then which reply was cheaper."""
    from declattn.api.results import PerAnswer

    out.print(per_answer_table(da, plain))
    out.print(per_step_line(da))
    out.print(f"[bold]{PerAnswer.of(da, plain).verdict()}[/]")


def summary(answers: dict[str, Answer]) -> dict[str, Any]:
    """The answers as JSON-ready dicts (``--json``); each arm's ``saving`` is per step
    (against the same reply read in full), ``per_answer`` (DA and vanilla both run) is
    DA's reply over the plain one (``PerAnswer``)."""
    out = {}
    for arm, a in answers.items():
        s = a.stats
        out[arm] = {
            "answer": a.answer,
            "text": a.text,
            "finish_reason": a.finish_reason,
            "declarations": [d.to_dict() for d in a.declarations],
            "declines": [d.to_dict() for d in a.declines],
            "stats": {
                "prompt_tokens": s.prompt_tokens,
                "output_tokens": s.output_tokens,
                "decode_steps": s.decode_steps,
                "prefill_seconds": s.prefill_seconds,
                "cached_tokens": s.cached_tokens,
                "disk_tokens": s.disk_tokens,
                "decode_seconds": s.decode_seconds,
                "logical_attended": s.logical_attended,
                "physical_attended": s.physical_attended,
                "vanilla_attended": s.vanilla_attended,
                "saving": s.saving,
                "bytes_read": s.bytes_read,
                "by_mode": s.by_mode,
            },
        }
    if "da" in answers and "vanilla" in answers:
        from dataclasses import asdict

        from declattn.api.results import PerAnswer

        pa = PerAnswer.of(answers["da"].stats, answers["vanilla"].stats)
        out["per_answer"] = {**asdict(pa), "verdict": pa.verdict()}
    return out
