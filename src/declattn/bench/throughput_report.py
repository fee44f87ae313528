"""``declattn bench throughput``: arguments, the run of each part, tables and the JSON.

Parts: ``inproc`` (the engine's batch API, ``throughput.py``), ``llama-batched``
(llama.cpp's ``llama-batched-bench`` on the same GGUF, ``llama_batched.py``: with
``inproc``, run after it for each context and N, so the two sit side by side), ``http``
(real servers, declattn against llama-server, ``throughput_http.py``), ``arrivals``
(streams while long prompts arrive: mixed steps against prefill-first) and ``budget``
(in process: the mixed step and the prompt's prefill rate per prefill budget).
Measurements, never tests.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from declattn.bench.llama_batched import BINARY as LLAMA_BATCHED

PARTS = ("inproc", "llama-batched", "http", "arrivals", "budget")


def add_arguments(p: argparse.ArgumentParser, ints: Callable[[str], tuple[int, ...]]) -> None:
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shipped name or a GGUF path")
    p.add_argument("--parts", default="inproc", help=f"comma separated: {', '.join(PARTS)}")
    p.add_argument("--contexts", type=ints, default=(8192, 16384, 32768),
                   help="document tokens per request (default 8192,16384,32768)")
    p.add_argument("--concurrency", type=ints, default=(1, 4, 8, 16),
                   help="requests at once (default 1,4,8,16)")
    p.add_argument("--arms", default=None,
                   help="inproc: vanilla,da-focus[,da]; http: declattn-vanilla,declattn-da,"
                   "llama-fa-on,llama-fa-off (default: all the part can run)")
    p.add_argument("--steps", type=int, default=32, help="inproc: timed decode steps")
    p.add_argument("--real-prefill", action="store_true",
                   help="inproc: prefill for real (the 'da' arm needs it; slow at 16K+)")
    p.add_argument("--max-tokens", type=int, default=128, help="http: tokens per request")
    p.add_argument("--threads", type=int, default=None, help="threads (default: idle cores)")
    p.add_argument("--llama-server", default=".venv-bench/bin/llama-server",
                   help="http: the llama-server binary (make bench-env builds it)")
    p.add_argument("--llama-batched-bench", default=LLAMA_BATCHED,
                   help="llama-batched: llama.cpp's batched decode benchmark (make bench-env)")
    p.add_argument("--llama-fa", default="on,off",
                   help="llama-batched: its flash-attention settings to run (on,off)")
    p.add_argument("--llama-shared-prompt", action="store_true",
                   help="llama-batched: prefill one prompt for all sequences (-pps; one "
                   "prefill instead of N, each sequence still reads all of its KV)")
    p.add_argument("--arrival-context", type=int, default=16384,
                   help="arrivals, budget: prompt tokens of each arriving request")
    p.add_argument("--arrivals", type=int, default=2, help="arrivals: requests that arrive")
    p.add_argument("--streams", type=int, default=4,
                   help="arrivals, budget: streams decoding meanwhile")
    p.add_argument("--rate", type=float, default=0.05, help="arrivals: per second (Poisson)")
    p.add_argument("--budgets", type=ints_or_zero, default=(0, 128, 256, 512),
                   help="arrivals, budget: prefill budgets to compare, 0 for prefill-first")
    p.add_argument("--seconds", type=float, default=900.0, help="arrivals: arrival window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench", help="directory for throughput.json")


def ints_or_zero(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from e
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0: {text!r}")
    return values


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """The parts ``args`` asks for; the result (also written as JSON)."""
    from declattn.api import Engine
    from declattn.bench.machine import machine_info
    from declattn.engine.registry import resolve_model
    from declattn.engine.threads import use_threads

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    threads = use_threads(args.threads).threads  # the servers are told it as a number
    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else None
    engine = Engine.from_pretrained(args.model)
    result: dict[str, Any] = {"model": args.model, "machine": machine_info(), "parts": {}}
    if "inproc" in parts or "llama-batched" in parts:
        _batch_parts(args, parts, threads, engine, arms, result, log)
    if "http" in parts:
        from declattn.bench.throughput_http import HTTP_ARMS, HttpConfig, run_http

        hcfg = HttpConfig(args.model, args.contexts, args.concurrency, arms or HTTP_ARMS,
                          args.max_tokens, threads, args.llama_server, seed=args.seed)
        gguf = resolve_model(args.model)
        result["parts"]["http"] = {"config": hcfg.to_dict(),
                                   "rows": run_http(hcfg, engine.tokenizer, gguf, log)}
    if "arrivals" in parts:
        from declattn.bench.throughput_http import ArrivalConfig, run_arrivals

        acfg = ArrivalConfig(args.model, args.arrival_context, args.streams,
                             arrivals=args.arrivals, rate=args.rate, seconds=args.seconds,
                             budgets=args.budgets, threads=threads, seed=args.seed)
        result["parts"]["arrivals"] = {"config": acfg.to_dict(),
                                       "rows": run_arrivals(acfg, engine.tokenizer, log)}
    if "budget" in parts:
        from declattn.bench.throughput import BudgetConfig, budget_sweep

        bcfg = BudgetConfig(args.arrival_context, args.streams,
                            prompt_tokens=args.arrival_context,
                            budgets=tuple(b for b in args.budgets if b) or (128, 256, 512),
                            seed=args.seed)
        result["parts"]["budget"] = {"config": bcfg.to_dict(),
                                     "rows": budget_sweep(engine, bcfg, log)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "throughput.json"
    path.write_text(json.dumps(result, indent=1))
    result["path"] = str(path)
    return result


def _batch_parts(args: argparse.Namespace, parts: list[str], threads: int, engine: Any,
                 arms: tuple[str, ...] | None, result: dict[str, Any],
                 log: Callable[[str], None]) -> None:
    """``inproc`` and ``llama-batched``, each context and N in turn, ours then llama.cpp's."""
    from declattn.bench.llama_batched import BatchedConfig, run_batched
    from declattn.bench.machine import BandwidthProbe
    from declattn.bench.throughput import InProcessConfig, measure
    from declattn.engine.registry import resolve_model

    icfg = InProcessConfig(args.contexts, args.concurrency,
                           arms or (("vanilla", "da-focus", "da") if args.real_prefill
                                    else ("vanilla", "da-focus")),
                           steps=args.steps, real_prefill=args.real_prefill, seed=args.seed)
    lcfg = BatchedConfig(args.contexts, args.concurrency, args.steps, threads,
                         tuple(f.strip() for f in args.llama_fa.split(",")),
                         args.llama_batched_bench, args.llama_shared_prompt)
    probe = BandwidthProbe()
    probe.sample()  # a first sample warms the buffers: not counted
    probe.copies.clear()
    probe.reads.clear()
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for context in args.contexts:
        for n in args.concurrency:
            if "inproc" in parts:
                ours.append(measure(engine, context, n, icfg, probe, log))
            if "llama-batched" in parts:
                one = BatchedConfig(**{**lcfg.to_dict(), "contexts": (context,),
                                       "concurrency": (n,)})
                theirs.extend(run_batched(one, resolve_model(args.model), log))
    if "inproc" in parts:
        result["parts"]["inproc"] = {"config": icfg.to_dict(), "rows": ours}
    if "llama-batched" in parts:
        result["parts"]["llama-batched"] = {"config": lcfg.to_dict(), "rows": theirs}


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def tables(result: dict[str, Any]) -> list[Table]:
    """One table per part run."""
    out = []
    parts = result["parts"]
    if "inproc" in parts:
        t = Table(title="in-process: aggregate decode tokens/s, N requests at once")
        for col in ("context", "N", "arm", "tok/s", "step ms", "ITL p99 ms", "KV MB/step",
                    "GB/s", "of probe", "roofline ms"):
            t.add_column(col, justify="right")
        for row in parts["inproc"]["rows"]:
            for arm, a in row["arms"].items():
                t.add_row(f"{row['context']:,}", str(row["n"]), arm,
                          _f(a["tokens_per_second"]), _f(a["step_ms_p50"], "{:.1f}"),
                          _f(a["inter_token_ms_p99"], "{:.1f}"),
                          _f(a["kv_bytes_per_step"] / 1e6, "{:.1f}"),
                          _f(a["read_bytes_per_s"] / 1e9, "{:.1f}"),
                          _f(a["read_share_of_probe"], "{:.0%}"),
                          _f(a["roofline_step_ms"], "{:.1f}"))
        out.append(t)
    if "llama-batched" in parts:
        t = Table(title="llama-batched-bench (llama.cpp): aggregate decode tokens/s, N at once")
        for col in ("context", "N", "arm", "tok/s", "step ms", "prefill s", "ours / best"):
            t.add_column(col, justify="right")
        ours = {(r["context"], r["n"]): r["arms"] for r in parts.get("inproc", {}).get("rows", [])}
        best: dict[tuple[int, int], float] = {}
        for row in parts["llama-batched"]["rows"]:
            key = (row["context"], row["n"])
            best[key] = max(best.get(key, 0.0), row["decode_tokens_per_second"])
        for row in parts["llama-batched"]["rows"]:
            key = (row["context"], row["n"])
            ratio = ", ".join(f"{arm} {a['tokens_per_second'] / best[key]:.2f}x"
                              for arm, a in ours.get(key, {}).items()) or "-"
            t.add_row(f"{row['context']:,}", str(row["n"]), row["arm"],
                      _f(row["decode_tokens_per_second"]), _f(row["step_ms"], "{:.1f}"),
                      _f(row["prefill_seconds"], "{:.0f}"), ratio)
        out.append(t)
    if "http" in parts:
        t = Table(title="through HTTP: N streamed requests at once")
        for col in ("context", "N", "arm", "tok/s", "steady tok/s", "TTFT p50 s",
                    "gap p50 s", "gap p99 s", "errors"):
            t.add_column(col, justify="right")
        for row in parts["http"]["rows"]:
            t.add_row(f"{row['context']:,}", str(row["n"]), row["arm"],
                      _f(row.get("tokens_per_second")), _f(row.get("steady_tokens_per_second")),
                      _f(row.get("ttft_p50"), "{:.1f}"), _f(row.get("gap_p50"), "{:.3f}"),
                      _f(row.get("gap_p99"), "{:.3f}"), str(len(row["errors"])))
        out.append(t)
    if "arrivals" in parts:
        t = Table(title="streams while long prompts arrive")
        for col in ("scheduling", "gap p50 s", "gap p99 s", "gap max s", "arrival TTFT s",
                    "TTFT / alone"):
            t.add_column(col, justify="right")
        for row in parts["arrivals"]["rows"]:
            ttft = ", ".join(f"{x:.1f}" for x in row["arrival_ttft"]) or "-"
            t.add_row(row["scheduling"], _f(row["stream_gap_p50"], "{:.3f}"),
                      _f(row["stream_gap_p99"], "{:.3f}"), _f(row["stream_gap_max"], "{:.3f}"),
                      ttft, _f(row["ttft_over_alone_max"]))
        out.append(t)
    if "budget" in parts:
        t = Table(title="in process: a prompt's pieces beside decoding streams, per budget")
        for col in ("budget", "decode step s", "mixed step p50 s", "mixed step max s",
                    "prompt tok/s", "prefill s", "over alone"):
            t.add_column(col, justify="right")
        for row in parts["budget"]["rows"]:
            t.add_row(str(row["budget"]), _f(row["decode_step_s"]),
                      _f(row["mixed_step_s_p50"]), _f(row["mixed_step_s_max"]),
                      _f(row["prompt_tokens_per_s"], "{:.1f}"), _f(row["prefill_s"], "{:.1f}"),
                      _f(row["prefill_over_alone"]))
        out.append(t)
    return out
