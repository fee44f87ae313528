"""``declattn roofline``: project decode time from a model config and attended tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.console import Console
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
        local = _run_cost(config, rows, args) if rows else None
    except (RooflineConfigError, OSError) as e:
        raise UserError(str(e)) from e
    con = Console(width=max(console().width, 110), highlight=False)
    con.print(_cost_table(cost, args))
    if rows is None:
        con.print(_context_table(cost, accs, args))
        return 0
    con.print(_results_table(cost, accs, rows, args, per_step=False))
    con.print(_results_table(cost, accs, rows, args, per_step=True))
    if not args.no_measure and local is not None:
        this = _this_machine(local, con)
        con.print(_measured_table(local, this, rows, args))
    return 0


def _run_cost(config: dict[str, Any], rows: list, args: argparse.Namespace) -> Any:
    """The cost model in the dtype the run itself used (recorded in its rows, or read off
    its byte counts), for the comparison with what it measured here."""
    from declattn.eval.roofline import model_cost, rows_kv_dtype

    shape = model_cost(config, dtype=args.dtype or "float32")
    used = rows_kv_dtype(rows, shape)
    if used is None:
        return None
    return model_cost(config, dtype=used, kv_dtype=used)


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


def _projected(cost: Any, acc: Any, rs: list, args: Any, per_step: bool, **kw: Any) -> float:
    """Mean projected decode seconds per response (or per decode step) of rows ``rs``."""
    from declattn.eval.roofline import project_steps, row_steps

    out = []
    for r in rs:
        steps = row_steps(r, args.reads)
        p = project_steps(cost, acc, steps, mfu=args.mfu, mbu=args.mbu, **kw).seconds
        out.append(p / max(1, len(steps)) if per_step else p)
    return fmean(out)


def _results_table(cost: Any, accs: list, rows: list, args: Any, *, per_step: bool) -> Table:
    unit, scale = ("us per decode step", 1e6) if per_step else ("ms per response", 1e3)
    t = Table(title=f"projected decode time, {unit} (x vanilla)")
    for c in ("model", "length", "arm", "n", "steps", *[a.name for a in accs]):
        t.add_column(c, justify="left" if c in ("model", "arm") else "right")
    kw = {"include_weights": args.include_weights}
    times = {
        key: {a.name: _projected(cost, a, rs, args, per_step, **kw) for a in accs}
        for key, rs in _groups(rows).items()
    }
    for (model, length, arm), rs in _groups(rows).items():
        ref = times.get((model, length, "vanilla"))
        cells = []
        for a in accs:
            value = times[(model, length, arm)][a.name]
            cell = f"{scale * value:.2f}"
            if ref and arm != "vanilla" and ref[a.name]:
                cell += f" ({value / ref[a.name]:.2f}x)"
            cells.append(cell)
        steps = fmean(r["totals"]["steps"] for r in rs)
        t.add_row(model, f"{length:,}", arm, str(len(rs)), f"{steps:.0f}", *cells)
    return t


def _this_machine(cost: Any, con: Any) -> Any:
    from declattn.bench.machine import measure_this_machine

    dtype = {4: "fp32", 2: "bf16"}.get(int(cost.weight_bytes_per_param), "fp32")
    with con.status("measuring this machine (matmul and bandwidth)"):
        acc = measure_this_machine(dtype)
    con.print(
        f"this machine: {acc.peak_flops / 1e9:,.1f} GFLOP/s, "
        f"{acc.bandwidth / 1e9:,.1f} GB/s ({acc.source})"
    )
    return acc


def _measured_table(cost: Any, acc: Any, rows: list, args: Any) -> Table:
    """Projection for this machine beside the decode time the runs measured, per decode
    step (ms), in the dtype the runs used."""
    t = Table(title="this machine: measured vs projected ms per decode step (x vanilla)")
    for c in ("model", "length", "arm", "n", "measured", "projected", "projected +weights"):
        t.add_column(c, justify="left" if c in ("model", "arm") else "right")
    figures: dict[tuple, tuple[float, float, float]] = {}
    for key, rs in _groups(rows).items():
        measured = fmean(r["timing"]["decode_seconds"] / max(1, r["totals"]["steps"]) for r in rs)
        proj = _projected(cost, acc, rs, args, True)
        heavy = _projected(cost, acc, rs, args, True, include_weights=True)
        figures[key] = (measured, proj, heavy)
    for (model, length, arm), values in figures.items():
        ref = figures.get((model, length, "vanilla"))
        cells = []
        for i, v in enumerate(values):
            cell = f"{1e3 * v:.3f}" if i else f"{1e3 * v:.1f}"
            if ref and arm != "vanilla" and ref[i]:
                cell += f" ({v / ref[i]:.2f}x)"
            cells.append(cell)
        n = len(_groups(rows)[(model, length, arm)])
        t.add_row(model, f"{length:,}", arm, str(n), *cells)
    return t
