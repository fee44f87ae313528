"""``declattn run``: answer a question over a document, DA on, and show what was read."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from declattn.cli.common import add_model_arg, console, read_context, require_question, user_errors
from declattn.cli.tables import MODE_STYLES, attended_table, declarations_table


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="answer a question over a document with DA")
    add_model_arg(p)
    p.add_argument("--context", required=True, help="a text file, or - for standard input")
    p.add_argument("--question", help="the question")
    arm = p.add_mutually_exclusive_group()
    arm.add_argument("--vanilla", action="store_true", help="ordinary prompt, full attention")
    arm.add_argument("--no-mask", action="store_true", help="DA prompt without masking (DA-nm)")
    arm.add_argument("--compare", action="store_true", help="run DA and vanilla side by side")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument(
        "--line-start", action="store_true", help="opening tags count only at line start"
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    p.add_argument(
        "--backend",
        choices=["engine", "vllm"],
        default="engine",
        help="our engine, or vLLM with the DA plugin (needs vLLM installed; docs/vllm.md)",
    )
    p.add_argument("--save", help="write the run record (JSON) here")
    p.add_argument("--json", action="store_true", help="print the result as JSON, no streaming")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.engine.threads import use_threads

    use_threads()  # one thread per idle core: a shared CPU thrashes otherwise
    question = require_question(args.question)
    context = read_context(args.context)
    if args.max_tokens < 1:
        from declattn.cli.common import UserError

        raise UserError("--max-tokens must be at least 1")
    if getattr(args, "backend", "engine") == "vllm":
        from declattn.vllm.run import run_cli

        with user_errors():
            return run_cli(args, context, question)
    out = console(stderr=args.json)
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model, dtype=args.dtype)
        arms = ["vanilla"] if args.vanilla else ["da-nm"] if args.no_mask else ["da"]
        if args.compare:
            arms = ["da", "vanilla"]
        answers = {a: _run_arm(engine, a, context, question, args, out) for a in arms}
    _report(answers, args, out, question)
    return 0


def _run_arm(engine: Any, arm: str, context: str, question: str, args: Any, out: Any) -> Any:
    import dataclasses

    options = dataclasses.replace(
        engine.da_defaults, masking=arm != "da-nm", line_start=args.line_start
    )
    results: list[Any] = []
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

        stream = engine.generate(
            context,
            question,
            da=arm != "vanilla",
            options=options,
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
    return results[0]


def _report(answers: dict[str, Any], args: Any, out: Any, question: str) -> None:
    from declattn.record import build_record, save_record

    records = {
        arm: build_record(a, model=args.model, question=question) for arm, a in answers.items()
    }
    if args.save:
        target = records if len(records) > 1 else next(iter(records.values()))
        if len(records) > 1:
            for arm, rec in records.items():
                save_record(rec, _arm_path(args.save, arm))
        else:
            save_record(target, args.save)
    if args.json:
        print(json.dumps(_summary(answers), indent=1, ensure_ascii=False))
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
        s = a.stats
        out.print(
            f"prompt {s.prompt_tokens:,} tokens; {s.output_tokens} generated; "
            f"prefill {s.prefill_seconds:.1f} s; decode {s.decode_seconds:.1f} s "
            f"({1000 * s.decode_seconds / max(1, s.decode_steps):.0f} ms/step); "
            f"KV read {s.bytes_read / 1e9:.2f} GB"
        )
    if len(answers) == 2:
        out.print(_compare_table(answers["da"], answers["vanilla"]))
    if args.save:
        out.print(f"run record: {args.save}")


def _arm_path(path: str, arm: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{arm}.{ext}" if dot else f"{path}.{arm}"


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


def _summary(answers: dict[str, Any]) -> dict[str, Any]:
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
