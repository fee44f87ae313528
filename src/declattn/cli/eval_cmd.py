"""``declattn eval``: accuracy against reads, for DA and the baselines, on generated tasks."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from declattn.cli.common import (
    UserError,
    add_dtype_arg,
    add_kv_cache_args,
    add_model_arg,
    add_threads_arg,
    console,
    kv_cache_kwargs,
    use_threads_arg,
    user_errors,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="accuracy against attended tokens: vanilla, DA arms and sparse baselines",
        description="Generate seeded long-context tasks, answer them with every arm in one "
        "engine, and write raw rows (JSONL), a summary table and plots. Rerunning with the "
        "same --out resumes: rows already written are skipped.",
    )
    add_model_arg(p)
    p.add_argument(
        "--tasks",
        default="niah_single_essay,vt,qa_squad",
        help="comma list of tasks or families (niah, vt, aggregation, qa, twohop), or all",
    )
    p.add_argument("--lengths", default="4K", help="comma list of token lengths (4096, 4K, 128K)")
    p.add_argument(
        "--arms",
        default="all",
        help="comma list of vanilla, vanilla-chunks, da-nm, da, da-constrained, da-find, "
        "da-find-constrained, da-find-index, da-economy, streaming, quest; or all; and "
        "da-model (the model's own DA settings: a model trained to declare), "
        "da-model-wrong (the same, every focused read forced to a chunk without the "
        "evidence)",
    )
    p.add_argument(
        "--budget-arm", default="da",
        help="the DA arm whose mean blocks per step the streaming and quest arms read",
    )
    p.add_argument("--samples", type=int, default=5, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0, help="seed of sample 0 (sample i: seed + i)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--chunk-target", type=int, default=2048, help="magic chunk size (tokens)")
    p.add_argument("--chunk-cap", type=int, default=2560)
    add_dtype_arg(p)
    p.add_argument("--judge-url", help="OpenAI-compatible base URL of an LLM judge (off if unset)")
    p.add_argument("--judge-model", help="the judge's model name")
    p.add_argument(
        "--judge-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the judge's API key",
    )
    add_threads_arg(p)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--no-prefix-cache", action="store_true",
        help="prefill every arm's prompt anew (by default arms over one prompt reuse its KV)",
    )
    add_kv_cache_args(p)
    p.add_argument(
        "--backend", choices=["engine", "vllm"], default="engine",
        help="engine: ours; vllm: the arms through vLLM 0.32 with the DA plugin, batched, "
        "prefix caching on (docs/vllm.md)",
    )
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
        help="with --backend vllm: a vllm.LLM keyword argument, VALUE read as JSON when it "
        "parses (e.g. tensor_parallel_size=2); repeatable",
    )
    p.set_defaults(func=run)


def parse_lengths(spec: str) -> list[int]:
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m:
            raise UserError(f"bad length {part!r}: use tokens like 4096 or 4K")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 256:
            raise UserError(f"length {n} is too short (at least 256 tokens)")
        out.append(n)
    if not out:
        raise UserError("no length given")
    return out


def run(args: argparse.Namespace) -> int:
    from declattn.eval.arms import ArmSettings, parse_arms
    from declattn.eval.tasks import resolve_tasks, turns_of

    try:
        tasks = resolve_tasks(args.tasks)
        arms = parse_arms(args.arms, args.budget_arm)
    except ValueError as e:
        raise UserError(str(e)) from e
    if args.backend == "vllm" and any(turns_of(t) for t in tasks):
        raise UserError("the agentic task runs on --backend engine only (its conversations "
                        "run turn by turn)")
    lengths = parse_lengths(args.lengths)
    if args.samples < 1:
        raise UserError("--samples must be at least 1")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.chunk_cap < args.chunk_target:
        raise UserError("--chunk-cap must be at least --chunk-target")
    threads = use_threads_arg(args)
    judge = _judge(args)
    from declattn.eval.runner import EvalSpec

    con = console()
    con.print(f"[dim]{threads.line()}[/]")

    spec = EvalSpec(
        model=args.model,
        tasks=tasks,
        lengths=lengths,
        arms=arms,
        samples=args.samples,
        seed=args.seed,
        settings=ArmSettings(
            args.max_tokens, args.chunk_target, args.chunk_cap, budget_arm=args.budget_arm
        ),
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with user_errors():
        if args.backend == "vllm":
            from declattn.cli.vllm_backend import evaluate as evaluate_vllm

            rows = evaluate_vllm(spec, out_dir, args, judge, con, _machine())
            _report(rows, out_dir, args, con)
            return 0
        from declattn.api import Engine

        def load() -> Any:
            with con.status(f"loading {args.model}"):
                return Engine.from_pretrained(
                    args.model, dtype=args.dtype, prefix_caching=not args.no_prefix_cache,
                    **kv_cache_kwargs(args),
                )

        rows = _run_with_progress(_Lazy(load), spec, out_dir, judge, con)
    _report(rows, out_dir, args, con)
    return 0


class _Lazy:
    """The engine, loaded on first use: a run whose rows are all written reports at once."""

    def __init__(self, load: Any) -> None:
        self._load, self._engine = load, None

    def __getattr__(self, name: str) -> Any:
        if self._engine is None:
            self._engine = self._load()
        return getattr(self._engine, name)


def _judge(args: argparse.Namespace) -> Any:
    if not args.judge_url:
        return None
    if not args.judge_model:
        raise UserError("--judge-url needs --judge-model")
    from declattn.eval.judge import Judge

    return Judge(args.judge_url, args.judge_model, os.environ.get(args.judge_key_env))


def _machine() -> dict[str, Any]:
    from declattn.bench.machine import machine_info

    return machine_info()


def _run_with_progress(engine: Any, spec: Any, out_dir: Path, judge: Any, con: Any) -> list:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from declattn.eval.runner import run_eval
    from declattn.eval.scoring import score

    results = out_dir / "results.jsonl"
    tally = {"right": 0.0, "n": 0, "resumed": 0}
    with Progress(
        TextColumn("[bold]eval[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=con,
    ) as progress:
        bar = progress.add_task("eval", total=spec.total, status="")

        def on_row(row: dict[str, Any], resumed: bool) -> None:
            if "error" not in row:
                tally["right"] += score(row["output"]["answer"], row["header"]).accuracy
                tally["n"] += 1
            tally["resumed"] += resumed
            acc = tally["right"] / tally["n"] if tally["n"] else 0.0
            progress.update(bar, advance=1, status=f"acc {acc:.0%}")

        def on_status(text: str) -> None:
            progress.update(bar, status=text)

        rows = run_eval(
            engine,
            spec,
            results,
            machine=_machine(),
            judge=judge,
            on_row=on_row,
            on_status=on_status,
        )
    if tally["resumed"]:
        con.print(f"resumed: {tally['resumed']} rows were already in {results}")
    return rows


def _report(rows: list, out_dir: Path, args: argparse.Namespace, con: Any) -> None:
    from declattn.eval.report import markdown_table, summary_json, summary_table, turn_table

    table = summary_table(rows, title=f"declattn eval: {args.model}", compact=True)
    # Piped output defaults to 80 columns, too few for the table: give it 100.
    wide = Console(width=max(con.width, 100), highlight=False, file=con.file)
    wide.print(table)
    turns = turn_table(rows, title=f"declattn eval: {args.model}, per turn")
    if turns is not None:
        wide.print(turns)
    (out_dir / "summary.json").write_text(json.dumps(summary_json(rows), indent=1))
    (out_dir / "summary.md").write_text(
        _markdown_header(rows, out_dir, args) + markdown_table(rows) + "\n"
    )
    written = [out_dir / "results.jsonl", out_dir / "summary.json", out_dir / "summary.md"]
    if not args.no_plots:
        from declattn.eval.plots import pareto_plot, savings_plot

        written.append(pareto_plot(rows, out_dir / "pareto.png"))
        written.append(savings_plot(rows, out_dir / "savings.png"))
    for path in written:
        con.print(f"wrote {path}")


def _command_line(args: argparse.Namespace) -> str:
    """The command as parsed (so a run started from Python reads the same as a shell one)."""
    import shlex

    parts = ["declattn", "eval"]
    for flag in (
        "model",
        "tasks",
        "lengths",
        "arms",
        "samples",
        "seed",
        "max_tokens",
        "chunk_target",
        "chunk_cap",
        "dtype",
        "judge_url",
        "judge_model",
        "backend",
        "out",
    ):
        value = getattr(args, flag)
        if value is not None:
            parts += [f"--{flag.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def _markdown_header(rows: list, out_dir: Path, args: argparse.Namespace) -> str:
    """Where the figures come from: the command, the machine and the dates of the rows."""
    dates = sorted(r["date"] for r in rows if "date" in r)
    machine = next((r["machine"] for r in rows if r.get("machine")), {})
    lines = [
        f"Summary written {time.strftime('%Y-%m-%d %H:%M %Z')} from {out_dir / 'results.jsonl'}",
        f"- command: `{_command_line(args)}`",
    ]
    if dates:
        lines.append(f"- responses run {dates[0]} to {dates[-1]}")
    if machine:
        keys = ("cpu", "cores", "torch_threads", "torch")
        lines.append("- machine: " + ", ".join(f"{k} {machine[k]}" for k in keys if k in machine))
    return "\n".join(lines) + "\n\n"
