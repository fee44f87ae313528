"""``declattn roofline``: project decode time from a model config and attended tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.table import Table

from declattn.cli.common import UserError, console


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "roofline",
        help="project decode time per response from config.json, attended tokens and hardware",
        description="T_step = dense FLOPs / (peak * MFU) + KV bytes read / (bandwidth * MBU). "
        "With --results, projects every arm of an eval run and, for this machine, prints the "
        "projection beside the measured decode time.",
    )
    p.add_argument("--config", help="a Hugging Face config.json (default: the results' model)")
    p.add_argument("--results", help="an eval results.jsonl to project")
    p.add_argument("--dtype", help="weights dtype (default: the config's torch_dtype)")
    p.add_argument("--kv-dtype", help="KV cache dtype (default: the weights' dtype)")
    p.add_argument(
        "--accelerators",
        default="all",
        help="comma list of A100, H100, H200, B200, MI300X, RTX5090, or all",
    )
    p.add_argument("--mfu", type=float, default=0.5, help="model FLOPs utilisation (0-1]")
    p.add_argument("--mbu", type=float, default=0.8, help="memory bandwidth utilisation (0-1]")
    p.add_argument(
        "--context",
        default="8K,32K,128K",
        help="context lengths for the per-step table (without --results)",
    )
    p.add_argument(
        "--saving",
        type=float,
        default=0.5,
        help="fraction of reads avoided, for the per-step table (without --results)",
    )
    p.add_argument(
        "--reads",
        choices=["logical", "physical"],
        default="logical",
        help="attended tokens (logical) or whole blocks (physical) as the KV read",
    )
    p.add_argument(
        "--include-weights",
        action="store_true",
        help="add weight bytes to the memory term (single-stream decode)",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="with --results: skip this machine's bandwidth and matmul test",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.eval.accelerators import resolve
    from declattn.eval.roofline import RooflineConfigError, config_for_model, model_cost

    if not (0 < args.mfu <= 1 and 0 < args.mbu <= 1):
        raise UserError("--mfu and --mbu must be in (0, 1]")
    try:
        accs = resolve(args.accelerators)
    except ValueError as e:
        raise UserError(str(e)) from e
    rows = _read_results(args.results) if args.results else None
    try:
        if args.config:
            config = _read_json(args.config)
        elif rows:
            config = config_for_model(rows[0]["model"])
        else:
            raise UserError("give --config (a config.json) or --results")
        cost = model_cost(config, dtype=args.dtype, kv_dtype=args.kv_dtype)
    except (RooflineConfigError, OSError) as e:
        raise UserError(str(e)) from e
    con = console()
    con.print(_cost_table(cost, args))
    if rows is None:
        con.print(_context_table(cost, accs, args))
        return 0
    this = None
    if not args.no_measure:
        this = _this_machine(cost, args, con)
    con.print(_results_table(cost, accs, rows, args))
    if this is not None:
        con.print(_measured_table(this, rows, args, config))
    return 0


def _read_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e})") from e


def _read_results(path: str) -> list[dict[str, Any]]:
    from declattn.eval.runner import read_rows

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file")
    rows = [r for r in read_rows(p) if "error" not in r]
    if not rows:
        raise UserError(f"{path}: no completed responses")
    return rows


def _cost_table(cost: Any, args: Any) -> Table:
    t = Table(title="per-token costs")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row(
        "layers (global + sliding)",
        f"{cost.n_layers} ({cost.global_layers} + {cost.sliding_layers})",
    )
    if cost.sliding_layers:
        t.add_row("sliding window", f"{cost.sliding_window:,}")
    heads = f"{cost.n_heads} / {cost.n_kv_heads} / {cost.head_dim}"
    t.add_row("heads / KV heads / head dim", heads)
    t.add_row("KV bytes per token (all layers)", f"{cost.kv_bytes_per_token:,.0f}")
    t.add_row("KV bytes per token per layer", f"{cost.kv_bytes_per_token_layer:,.0f}")
    t.add_row("dense FLOPs per token", f"{cost.dense_flops_per_token:,.0f}")
    t.add_row("weight bytes", f"{cost.params * cost.weight_bytes_per_param:,.0f}")
    t.add_row("MFU / MBU", f"{args.mfu} / {args.mbu}")
    return t


def _context_table(cost: Any, accs: list, args: Any) -> Table:
    from declattn.cli.eval_cmd import parse_lengths

    t = Table(title=f"one decode step: full attention vs {args.saving:.0%} of reads saved")
    for c in ("accelerator", "context", "full (us)", "saved (us)", "ratio"):
        t.add_column(c, justify="left" if c == "accelerator" else "right")
    for acc in accs:
        for n in parse_lengths(args.context):
            kw = {"mfu": args.mfu, "mbu": args.mbu, "include_weights": args.include_weights}
            full = cost.step_seconds(acc, n, n, **kw)
            part = cost.step_seconds(acc, n * (1 - args.saving), n, **kw)
            t.add_row(
                acc.name, f"{n:,}", f"{1e6 * full:.1f}", f"{1e6 * part:.1f}", f"{part / full:.2f}x"
            )
    return t


def _groups(rows: list) -> dict[tuple, list]:
    from declattn.eval.metrics import group

    return group(rows, "model", "length", "arm")


def _results_table(cost: Any, accs: list, rows: list, args: Any) -> Table:
    from declattn.eval.roofline import project_steps, row_steps

    t = Table(title="projected decode time per response (ms), and against vanilla")
    for c in ("model", "length", "arm", "n", "steps", *[a.name for a in accs]):
        t.add_column(c, justify="left" if c in ("model", "arm") else "right")
    groups = _groups(rows)
    kw = {"mfu": args.mfu, "mbu": args.mbu, "include_weights": args.include_weights}
    base: dict[tuple, dict[str, float]] = {}
    for (model, length, arm), rs in groups.items():
        times = {
            a.name: fmean(
                project_steps(cost, a, row_steps(r, args.reads), **kw).seconds for r in rs
            )
            for a in accs
        }
        if arm == "vanilla":
            base[(model, length)] = times
    for (model, length, arm), rs in groups.items():
        times = {
            a.name: fmean(
                project_steps(cost, a, row_steps(r, args.reads), **kw).seconds for r in rs
            )
            for a in accs
        }
        ref = base.get((model, length))
        cells = []
        for a in accs:
            cell = f"{1e3 * times[a.name]:.2f}"
            if ref and arm != "vanilla" and ref[a.name]:
                cell += f" ({times[a.name] / ref[a.name]:.2f}x)"
            cells.append(cell)
        steps = fmean(r["totals"]["steps"] for r in rs)
        t.add_row(model, f"{length:,}", arm, str(len(rs)), f"{steps:.0f}", *cells)
    return t


def _this_machine(cost: Any, args: Any, con: Any) -> Any:
    from declattn.eval.accelerators import measure_this_machine

    dtype = "bf16" if cost.weight_bytes_per_param == 2 else "fp32"
    with con.status("measuring this machine (matmul and bandwidth)"):
        acc = measure_this_machine(dtype)
    con.print(
        f"this machine: {acc.peak_flops / 1e9:,.1f} GFLOP/s, "
        f"{acc.bandwidth / 1e9:,.1f} GB/s ({acc.source})"
    )
    return acc


def _measured_table(acc: Any, rows: list, args: Any, config: dict) -> Table:
    """Projection for this machine beside the decode time the runs measured."""
    from declattn.eval.roofline import model_cost, project_steps, row_steps

    cost = model_cost(config, dtype=args.dtype, kv_dtype=args.kv_dtype)
    t = Table(title="this machine: measured vs projected decode seconds per response")
    for c in (
        "model",
        "length",
        "arm",
        "n",
        "measured",
        "projected",
        "proj. +weights",
        "measured/vanilla",
        "projected/vanilla",
        "+weights/vanilla",
    ):
        t.add_column(c, justify="left" if c in ("model", "arm") else "right")
    kw = {"mfu": args.mfu, "mbu": args.mbu}
    figures: dict[tuple, tuple[float, float, float]] = {}
    for key, rs in _groups(rows).items():
        measured = fmean(r["timing"]["decode_seconds"] for r in rs)
        proj = fmean(project_steps(cost, acc, row_steps(r, args.reads), **kw).seconds for r in rs)
        heavy = fmean(
            project_steps(cost, acc, row_steps(r, args.reads), include_weights=True, **kw).seconds
            for r in rs
        )
        figures[key] = (measured, proj, heavy)
    for (model, length, arm), (m, p, w) in figures.items():
        ref = figures.get((model, length, "vanilla"))
        ratios = [
            f"{x / y:.2f}x" if ref and y else "-"
            for x, y in zip((m, p, w), ref or (0, 0, 0), strict=True)
        ]
        t.add_row(
            model,
            f"{length:,}",
            arm,
            str(len(_groups(rows)[(model, length, arm)])),
            f"{m:.2f}",
            f"{p:.4f}",
            f"{w:.2f}",
            *ratios,
        )
    return t
