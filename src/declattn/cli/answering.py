"""Answering on the terminal: stream one arm's response coloured by mode, then report
what it read. ``declattn run`` and ``declattn demo`` both show answers this way."""

from __future__ import annotations

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


def report_answers(
    answers: dict[str, Answer],
    args: Any,
    out: Any,
    question: str,
    save: str | None = None,
    evidence: list[int] | None = None,
) -> None:
    """Save the run records (``save``, one per arm when several) and print each arm's
    answer, attended-token table, declarations and timing; DA against vanilla last.
    ``evidence``: the chunks holding what the question needs, when known (the records
    then say whether each focus held it)."""
    from declattn.show.record import build_record, save_record

    records = {
        arm: build_record(a, model=args.model, question=question, evidence=evidence)
        for arm, a in answers.items()
    }
    if save:
        if len(records) > 1:
            for arm, rec in records.items():
                save_record(rec, suffixed(save, arm))
        else:
            save_record(next(iter(records.values())), save)
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
                rec["by_mode"], rec["totals"], f"{arm}: attended tokens per decode step, summed"
            )
        )
        decl = declarations_table(rec["declarations"])
        if decl is not None:
            out.print(decl)
        out.print(timing_line(a.stats))
    if len(answers) == 2:
        out.print(_compare_table(answers["da"], answers["vanilla"]))
    if save:
        out.print(f"run record: {save}")


def suffixed(path: str, tag: str) -> str:
    """``run.json`` -> ``run.TAG.json``: one file per arm or per question."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{tag}.{ext}" if dot else f"{path}.{tag}"


def _compare_table(da: Any, van: Any) -> Table:
    t = Table(title="DA vs vanilla, same engine, same process")
    for col in ("", "DA", "vanilla", "DA / vanilla"):
        t.add_column(col, justify="right")
    rows = [
        ("decode steps", da.stats.decode_steps, van.stats.decode_steps),
        ("attended tokens", da.stats.logical_attended, van.stats.logical_attended),
        ("KV bytes read", da.stats.bytes_read, van.stats.bytes_read),
        ("decode seconds", da.stats.decode_seconds, van.stats.decode_seconds),
    ]
    for name, a, b in rows:
        fa = f"{a:.2f}" if isinstance(a, float) else f"{a:,}"
        fb = f"{b:.2f}" if isinstance(b, float) else f"{b:,}"
        t.add_row(name, fa, fb, f"{a / b:.2f}x" if b else "-")
    per_a = da.stats.decode_seconds / max(1, da.stats.decode_steps)
    per_b = van.stats.decode_seconds / max(1, van.stats.decode_steps)
    t.add_row(
        "seconds per step",
        f"{per_a:.4f}",
        f"{per_b:.4f}",
        f"{per_a / per_b:.2f}x" if per_b else "-",
    )
    return t


def summary(answers: dict[str, Answer]) -> dict[str, Any]:
    """The answers as JSON-ready dicts (``--json``)."""
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
    return out
