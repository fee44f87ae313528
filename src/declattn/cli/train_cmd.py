"""``declattn train``: train ``da-tiny`` here, and evaluate a declaring model held-out."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from declattn.cli.common import UserError, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train da-tiny or a LoRA adapter; evaluate a model "
                       "trained to declare")
    s = p.add_subparsers(dest="train_command", required=True)
    t = s.add_parser("da-tiny", help="train the tiny declaring model from scratch (CPU)")
    t.add_argument("--out", required=True, help="model directory to write")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch", type=int, default=None)
    t.add_argument(
        "--unmasked", type=float, default=None,
        help="share of training sequences without DA masks, meant to serve the vanilla "
        "arm too (default 0; 0.25 missed the gate here, see docs/training.md)",
    )
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--no-gate", action="store_true", help="skip the accuracy gate")
    t.set_defaults(func=run_train)
    lo = s.add_parser(
        "da-lora", help="teach a shipped real model to declare with a LoRA adapter (CPU)"
    )
    lo.add_argument("--base", default="qwen2.5-0.5b",
                    help="the shipped base model: qwen2.5-0.5b or smollm2-135m")
    lo.add_argument("--out", required=True, help="directory for the adapter and the run "
                    "(an unfinished run there resumes from its checkpoint)")
    lo.add_argument("--steps", type=int, default=None)
    lo.add_argument("--batch", type=int, default=None, help="sequences per optimiser step")
    lo.add_argument("--lr", type=float, default=None)
    lo.add_argument("--seed", type=int, default=None)
    lo.add_argument("--max-context", type=int, default=None,
                    help="longest context of a training document, in tokens")
    lo.add_argument("--heldout", type=int, default=None, help="held-out sequences")
    lo.add_argument("--heldout-every", type=int, default=None)
    lo.add_argument("--threads", type=int, default=None, help="torch threads (default: all "
                    "idle cores)")
    lo.set_defaults(func=run_da_lora)
    rq = s.add_parser(
        "requant-cost", help="held-out loss of an adapter: as trained, merged into GGUF "
        "blocks, and the base",
    )
    rq.add_argument("--adapter", required=True, help="a directory from train da-lora")
    rq.add_argument("--heldout", type=int, default=6, help="held-out sequences")
    rq.add_argument(
        "--variant", action="append", default=[], metavar="FORMAT:PROJ,PROJ",
        help="also merge with these projections written afresh in FORMAT (e.g. "
        "Q8_0:q_proj,k_proj,v_proj,o_proj); repeatable",
    )
    rq.add_argument("--threads", type=int, default=None)
    rq.set_defaults(func=run_requant_cost)
    st = s.add_parser(
        "study", help="a base model's and a trained model's `declattn eval` runs as one "
        "study: per family accuracy and focus on the evidence, per answer against the "
        "base model's vanilla answer (Markdown)",
    )
    st.add_argument("base", help="results.jsonl of the base model's run (arms vanilla and "
                    "a zero-shot DA arm)")
    st.add_argument("trained", help="results.jsonl of the trained model's run (arms "
                    "da-model, da-model-wrong, vanilla)")
    st.set_defaults(func=run_study)
    e = s.add_parser("eval", help="held-out accuracy and reads of a declaring model")
    e.add_argument("--model", required=True, help="a model directory (from train da-tiny)")
    e.add_argument("--samples", type=int, default=200)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--json", help="also write the table as JSON here")
    e.set_defaults(func=run_eval)


def run_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from declattn.engine.threads import use_threads
    from declattn.train.da_tiny import TinySpec, train_da_tiny

    spec = TinySpec(seed=args.seed)
    if args.steps is not None:
        spec = replace(spec, steps=args.steps)
    if args.batch is not None:
        spec = replace(spec, batch=args.batch)
    if args.unmasked is not None:
        spec = replace(spec, unmasked=args.unmasked)
    if spec.steps < 1 or spec.batch < 1:
        raise UserError("--steps and --batch must be at least 1")
    if not 0.0 <= spec.unmasked <= 1.0:
        raise UserError(f"--unmasked must be between 0 and 1, got {spec.unmasked}")
    use_threads(args.threads)
    out, con = Path(args.out), console()
    with Progress(
        TextColumn("[bold]training da-tiny"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=con,
    ) as progress:
        task = progress.add_task("train", total=spec.steps, loss=float("nan"))

        def on_step(step: int, loss: float, lr: float) -> None:
            progress.update(task, completed=step + 1, loss=loss)

        log = train_da_tiny(spec, out, on_step)
    con.print(f"wrote {out} (final loss {log[-1]['loss']}, {log[-1]['seconds']} s)")
    if args.no_gate:
        return 0
    from declattn.api import Engine
    from declattn.train.evaluate import run_cell
    from declattn.train.roles import role_report

    engine = Engine.from_pretrained(out, dtype="fp32")
    cell = run_cell(engine, spec.max_chunks, False, "da", spec.gate_samples, seed=spec.seed + 1)
    con.print(f"gate: 1-hop, {spec.max_chunks} chunks, DA: {cell.correct}/{cell.samples}")
    if cell.accuracy < spec.gate_accuracy:
        roles = role_report(engine.loaded.model, engine.tokenizer, spec.max_chunks)
        con.print(_roles_table(roles, spec.max_chunks))
        raise UserError(
            f"the lookup did not form: accuracy {cell.accuracy:.0%} < {spec.gate_accuracy:.0%} "
            f"(the model in {out} is not shipped; the table shows what it did learn)"
        )
    return 0


def run_da_lora(args: argparse.Namespace) -> int:
    import sys

    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from declattn.engine.registry import MODELS
    from declattn.engine.threads import use_threads
    from declattn.train.da_lora import LoRARun, RunMismatch, train_da_lora, with_overrides
    from declattn.train.da_lora import Progress as RunProgress

    if args.base not in ("qwen2.5-0.5b", "smollm2-135m") or args.base not in MODELS:
        raise UserError(f"--base must be qwen2.5-0.5b or smollm2-135m, not {args.base!r}")
    run = with_overrides(
        LoRARun(base=args.base), steps=args.steps, batch=args.batch, lr=args.lr,
        seed=args.seed, max_context=args.max_context, heldout=args.heldout,
        heldout_every=args.heldout_every,
    )
    if run.steps < 1 or run.batch < 1 or run.heldout < 1 or run.heldout_every < 1:
        raise UserError("--steps, --batch, --heldout and --heldout-every must be at least 1")
    if run.max_context < run.min_context:
        raise UserError(f"--max-context must be at least {run.min_context}")
    threads = use_threads(args.threads)
    out, con = Path(args.out), console()
    con.print(f"da-lora: {run.base}, {run.steps} steps of {run.batch} sequences, "
              f"{threads} thread(s); held-out loss every {run.heldout_every} steps")
    with Progress(
        TextColumn("[bold]training da-lora"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}  held-out {task.fields[held]}"),
        TimeElapsedColumn(), console=con,
    ) as bar:
        task = bar.add_task("train", total=run.steps, loss=float("nan"), held="-")

        def on_step(step: int, loss: float, lr: float) -> None:
            bar.update(task, completed=step + 1, loss=loss)
            if step % 5 == 4:
                if not con.is_terminal:  # a log file gets a line where a bar would move
                    bar.console.print(f"step {step + 1}/{run.steps}: loss {loss:.4f}, "
                                      f"lr {lr:.2e}, {torch.get_num_threads()} thread(s)")
                if args.threads is None:
                    use_threads(None)  # the machine is shared: follow its idle cores

        def on_heldout(step: int, loss: float) -> None:
            bar.update(task, held=f"{loss:.3f}")
            bar.console.print(f"step {step}: held-out loss {loss:.4f}")

        try:
            with user_errors():
                record = train_da_lora(run, out, RunProgress(on_step, on_heldout),
                                       command=" ".join(["declattn", *sys.argv[1:]]))
        except RunMismatch as e:
            raise UserError(str(e)) from e
    con.print(f"wrote {out}: {record['seconds']:.0f} s of training, held-out loss "
              f"{record['heldout'][0]['loss']} -> {record['heldout'][-1]['loss']}")
    return 0


def run_requant_cost(args: argparse.Namespace) -> int:
    from gguf import GGMLQuantizationType

    from declattn.engine.threads import use_threads
    from declattn.train.da_lora import TRAINING_FILE, LoRARun
    from declattn.train.requant_cost import requant_cost

    directory = Path(args.adapter)
    record = directory / TRAINING_FILE
    run = LoRARun(**json.loads(record.read_text())["run"]) if record.is_file() else LoRARun()
    formats = []
    for spec in args.variant:
        fmt, _, projs = spec.partition(":")
        try:
            kind = GGMLQuantizationType[fmt.upper()]
        except KeyError:
            raise UserError(f"--variant {spec!r}: unknown GGUF format {fmt!r}") from None
        if not projs:
            raise UserError(f"--variant {spec!r}: name the projections after the colon")
        formats.append(dict.fromkeys(projs.split(","), kind))
    use_threads(args.threads)
    con = console()
    t = Table(title=f"{directory}: held-out loss ({args.heldout} sequences, nats per reply "
              "token)")
    for col in ("variant", "loss", "codes changed", "update kept", "relative error"):
        t.add_column(col, justify="left" if col == "variant" else "right")

    def show(v: Any) -> None:
        r = v.report or {}
        con.print(f"{v.name}: {v.loss:.4f}")
        t.add_row(v.name, f"{v.loss:.4f}",
                  *(f"{r[k]:.2%}" if k in r else "-" for k in ("codes_changed", "kept")),
                  f"{r['error']:.2f}" if "error" in r else "-")

    with user_errors():
        requant_cost(directory, run, args.heldout, formats, show)
    con.print(t)
    return 0


def _roles_table(roles: list[Any], n_chunks: int) -> Table:
    t = Table(title=f"teacher forced, 1-hop, {n_chunks} chunks: what each reply token needs")
    for col in ("role", "tokens", "accuracy", "loss (nats)"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for r in roles:
        t.add_row(r.role, str(r.tokens), f"{r.accuracy:.1%}", f"{r.loss:.3f}")
    return t


def run_eval(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.engine.threads import use_threads
    from declattn.train.evaluate import DEFAULT_GRID, run_cell
    from declattn.train.roles import role_report

    if args.samples < 1:
        raise UserError("--samples must be at least 1")
    use_threads(args.threads)
    con = console()
    with user_errors():
        engine = Engine.from_pretrained(args.model, dtype="fp32")
    cells = []
    t0 = time.perf_counter()
    with con.status("evaluating") as status:
        for n, two, arm in DEFAULT_GRID:
            status.update(f"{'2' if two else '1'}-hop, {n} chunks, {arm}")
            cells.append(run_cell(engine, n, two, arm, args.samples, seed=args.seed))
    con.print(_table(cells, args))
    roles = role_report(engine.loaded.model, engine.tokenizer, 16, seed=args.seed)
    con.print(_roles_table(roles, 16))
    con.print(f"{time.perf_counter() - t0:.0f} s; seed {args.seed}; fp32; greedy")
    if args.json:
        rows = [{**c.__dict__, "accuracy": c.accuracy} for c in cells]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run_study(args: argparse.Namespace) -> int:
    from declattn.eval.runner import read_rows
    from declattn.eval.study import study_markdown

    runs = []
    for path in (Path(args.base), Path(args.trained)):
        if not path.is_file():
            raise UserError(f"{path}: no such results file (a `declattn eval` run's "
                            "results.jsonl)")
        runs.append(read_rows(path))
    if not all(runs):
        raise UserError("a results file holds no rows")
    print(study_markdown(*runs))
    return 0


def _table(cells: list[Any], args: argparse.Namespace) -> Table:
    t = Table(title=f"{args.model}: held-out, {args.samples} samples per row")
    for col in ("task", "arm", "accuracy", "focus on evidence", "declines", "attended",
                "attended (blocks)"):
        t.add_column(col, justify="left" if col in ("task", "arm") else "right")
    for c in cells:
        t.add_row(
            c.task, c.arm, f"{c.accuracy:.1%}", f"{c.focus_ok / c.samples:.1%}",
            str(c.declines), f"{c.attended:.1%}", f"{c.physical:.1%}",
        )
    return t
