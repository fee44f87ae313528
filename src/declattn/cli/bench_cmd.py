"""``declattn bench``: measurements, never asserted in tests (the machines are shared)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from declattn.cli.common import UserError, add_model_arg, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (segmenter, decode attention, end to end)")
    bsub = p.add_subparsers(dest="bench", required=True)
    seg = bsub.add_parser("segment", help="segment a long text (1M tokens by default)")
    seg.add_argument("--tokenizer", default="smollm2-135m")
    seg.add_argument("--tokens", type=int, default=1_000_000)
    seg.add_argument("--json", action="store_true")
    seg.set_defaults(func=run_segment)
    dec = bsub.add_parser(
        "decode",
        help="decode speed: attention per mode vs bytes read, DA vs vanilla end to end, "
        "and against transformers",
    )
    dec.add_argument("--contexts", type=_ints, default=None,
                     help="micro-benchmark contexts, comma separated (default 4096,16384,32768)")
    dec.add_argument("--e2e-contexts", type=_ints, default=None,
                     help="end-to-end contexts for the KV-heavy model (default 16384,65536)")
    dec.add_argument("--smol-e2e-contexts", type=_ints, default=None,
                     help="end-to-end contexts for SmolLM2 (default 16384)")
    dec.add_argument("--hf-contexts", type=_ints, default=None,
                     help="contexts for the transformers comparison (default 4096,16384)")
    dec.add_argument("--output-tokens", type=int, default=None,
                     help="tokens in the forced transcript (default 160)")
    dec.add_argument("--repeats", type=int, default=None, help="micro-benchmark repeats")
    dec.add_argument("--parts", default="micro,e2e,hf",
                     help="which parts to run, comma separated (micro, e2e, hf)")
    dec.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: one per core measured idle at the start)")
    dec.add_argument("--quick", action="store_true", help="small sizes: a sanity run")
    dec.add_argument("--out", default="out/bench", help="directory for the JSON and PNG")
    dec.set_defaults(func=run_decode)
    vl = bsub.add_parser(
        "vllm", help="decode time on vLLM (CPU build) with the DA plugin, DA vs DA-nm"
    )
    vl.add_argument("--model", default="smollm2-135m")
    vl.add_argument("--context-tokens", type=int, default=None,
                    help="document tokens (default 7000: SmolLM2 has 8,192 positions)")
    vl.add_argument("--output-tokens", type=int, default=None,
                    help="tokens in the forced transcript")
    vl.add_argument("--repeats", type=int, default=None, help="runs per arm, alternating")
    vl.add_argument("--json", action="store_true")
    vl.add_argument("--out", default="out/bench", help="directory for the JSON")
    vl.set_defaults(func=run_vllm)
    ru = bsub.add_parser(
        "reuse",
        help="many questions over one document: prefilled once (prefix cache) against "
        "independent requests, side by side; --server also through the HTTP server",
    )
    add_model_arg(ru, default="qwen2.5-0.5b")
    ru.add_argument("--tokens", type=int, default=16_000, help="document tokens")
    ru.add_argument("--questions", type=int, default=5)
    ru.add_argument("--independent", type=int, default=2,
                    help="how many of the questions also run as independent requests")
    ru.add_argument("--max-tokens", type=int, default=96)
    ru.add_argument("--seed", type=int, default=0)
    ru.add_argument("--server", action="store_true", help="repeat through the server")
    ru.add_argument("--across-processes", action="store_true",
                    help="instead: a cold question in a fresh process, the same question in a "
                    "new process (KV from the disk tier) and a second question in the first "
                    "(KV from memory); in a temporary cache directory, removed after")
    ru.add_argument("--threads", type=int, default=None)
    ru.add_argument("--out", default="out/bench", help="directory for the JSON")
    ru.set_defaults(func=run_reuse)
    so = bsub.add_parser(
        "serve",
        help="soak a real server on loopback with mixed, partly hostile traffic (bounded)",
    )
    add_model_arg(so, default="smollm2-135m")
    so.add_argument("--seconds", type=float, default=1800.0, help="soak length (default 30 min)")
    so.add_argument("--max-requests", type=int, default=20000)
    so.add_argument("--clients", type=int, default=8, help="requests at once (default 8)")
    so.add_argument("--kv-blocks", type=int, default=2048)
    so.add_argument("--long-tokens", type=int, default=4096,
                    help="document tokens of the long DA requests (default 4096)")
    so.add_argument("--rss-every", type=float, default=10.0,
                    help="seconds between samples of the server's memory (default 10)")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--out", default="out/bench", help="directory for the JSON")
    so.set_defaults(func=run_soak)
    pe = bsub.add_parser(
        "peers", help="declattn against llama.cpp on the same GGUF: prefill, decode, bytes"
    )
    from declattn.bench.peers_report import add_arguments

    add_arguments(pe, _ints)
    pe.set_defaults(func=run_peers)
    th = bsub.add_parser(
        "throughput",
        help="N concurrent long-context requests: aggregate tokens/s, inter-token latency, "
        "bytes per step; in process, through the server against llama-server, and with "
        "prompts arriving while streams decode",
    )
    from declattn.bench.throughput_report import add_arguments as throughput_arguments

    throughput_arguments(th, _ints)
    th.set_defaults(func=run_throughput)
    we = bsub.add_parser(
        "weights", help="accuracy of packed GGUF weights against the file dequantised to fp32"
    )
    add_model_arg(we, default="qwen2.5-0.5b")
    we.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt")
    we.set_defaults(func=run_weights)


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers; an empty string is none (skips that run)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from e
    if values and min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def run_segment(args: argparse.Namespace) -> int:
    from declattn.bench.segment import bench_segment
    from declattn.engine.tokenizer import load_tokenizer

    with user_errors():
        tok = load_tokenizer(args.tokenizer)
    result = bench_segment(tok, n_tokens=args.tokens)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        console().print(
            f"segmented {result['tokens']:,} tokens ({result['chars']:,} chars) into "
            f"{result['chunks']} chunks in {result['seconds']:.2f} s "
            f"({result['tokens_per_second']:,.0f} tokens/s)"
        )
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.bench.decode import DecodeBenchConfig, run_decode_bench, write_result
    from declattn.bench.decode_report import machine_line, tables
    from declattn.engine.threads import use_threads

    threads = use_threads(args.threads).threads
    overrides = {
        "contexts": args.contexts,
        "e2e_contexts": args.e2e_contexts,
        "smol_e2e_contexts": args.smol_e2e_contexts,
        "hf_contexts": args.hf_contexts,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
        "parts": tuple(p.strip() for p in args.parts.split(",") if p.strip()),
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = (
            DecodeBenchConfig.quick_config(**overrides)
            if args.quick
            else DecodeBenchConfig(**overrides)
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    out = console()
    err = console(stderr=True)
    err.print(f"torch threads: {threads}")
    with user_errors():
        result = run_decode_bench(cfg, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    path, png = write_result(result, Path(args.out))
    out.print(machine_line(result))
    for table in tables(result):
        out.print(table)
    out.print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.bench.vllm_decode import VllmBenchConfig, run_vllm_bench, write_result

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError("bench vllm needs vLLM in this environment (docs/vllm.md)") from e
    overrides = {
        "model": args.model,
        "context_tokens": args.context_tokens,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
    }
    try:
        cfg = VllmBenchConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise UserError(str(e)) from e
    err = console(stderr=True)
    with user_errors():
        result = run_vllm_bench(cfg, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    path = write_result(result, Path(args.out))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    console().print(
        f"vLLM decode, {result['prompt_tokens']:,}-token prompt, {result['output_tokens']} "
        f"forced tokens: DA {result['da_decode_seconds']:.2f} s, DA-nm "
        f"{result['vanilla_decode_seconds']:.2f} s, ratio {result['ratio']:.2f}x "
        f"(median step {result['ratio_median_step']:.2f}x; blocks read "
        f"{result['blocks_ratio']:.2f}x); {result['machine']}, {result['date']}\nwrote {path}"
    )
    return 0


def run_weights(args: argparse.Namespace) -> int:
    from declattn.bench.quant_accuracy import markdown, measure
    from declattn.engine.threads import use_threads

    use_threads(1)
    with user_errors():
        console().print(markdown(measure(args.model, steps=args.steps)))
    return 0


def run_peers(args: argparse.Namespace) -> int:
    from declattn.bench.peers_report import run

    with user_errors():
        return run(args)


def run_throughput(args: argparse.Namespace) -> int:
    from declattn.bench.throughput_report import run, tables

    err = console(stderr=True)
    try:
        with user_errors():
            result = run(args, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    except ValueError as e:
        raise UserError(str(e)) from e
    con = console()
    for table in tables(result):
        con.print(table)
    m = result["machine"]
    con.print(f"{result['model']}, {m['cpu']}, {m['torch_threads']} threads, {m['date']}; "
              f"wrote {result['path']}")
    return 0


def run_reuse(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.api import Engine
    from declattn.bench.machine import machine_info
    from declattn.bench.reuse import ReuseConfig
    from declattn.bench.reuse import run_reuse as bench
    from declattn.engine.threads import use_threads

    if args.questions < 1 or not 0 <= args.independent <= args.questions:
        raise UserError("--questions must be >= 1 and --independent in [0, --questions]")
    threads = use_threads(args.threads).threads
    cfg = ReuseConfig(args.tokens, args.questions, args.independent, args.max_tokens,
                      args.seed, args.server)
    err = console(stderr=True)
    if args.across_processes:
        return _reuse_across_processes(args, cfg, threads, err)
    with user_errors():
        # the first question is the cold one: nothing from an earlier run's disk tier
        engine = Engine.from_pretrained(args.model, kv_disk=False)
        result = bench(engine, cfg, log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result["machine"] = machine_info() | {"torch_threads": threads}
    result["model"] = args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "reuse.json"
    path.write_text(json.dumps(result, indent=1))
    con = console()
    for part in ("engine", "server"):
        if part in result:
            con.print(_reuse_table(part, result[part]))
    con.print(f"wrote {path}")
    return 0


def _reuse_across_processes(args: argparse.Namespace, cfg: Any, threads: int, err: Any) -> int:
    from pathlib import Path

    from rich.table import Table

    from declattn.bench.machine import machine_info
    from declattn.bench.reuse_processes import run_across_processes

    with user_errors():
        r = run_across_processes(args.model, cfg, threads,
                                 log=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    r |= {"config": cfg.to_dict(), "model": args.model,
          "machine": machine_info() | {"torch_threads": threads}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "reuse_processes.json"
    path.write_text(json.dumps(r, indent=1))
    t = Table(title=f"{args.model}: one document across processes")
    for col in ("question", "TTFT s", "memory / disk / computed tokens", "correct"):
        t.add_column(col, justify="right")
    for name, key in (("cold process, question 1", "cold"),
                      ("same process, question 2", "in_process_second"),
                      ("new process, question 1", "new_process")):
        a = r[key]
        memory = a["cached_tokens"] - a["disk_tokens"]
        computed = a["prompt_tokens"] - a["cached_tokens"]
        t.add_row(name, f"{a['ttft_seconds']:.2f}",
                  f"{memory:,} / {a['disk_tokens']:,} / {computed:,}",
                  "yes" if a["expected"].lower() in (a["answer"] or "").lower() else "no")
    per_token = r["disk_bytes_per_cached_token"]
    t.caption = (
        f"new process / cold: {r['new_over_cold']:.4f} (goal <= {r['goals']['new_over_cold']}); "
        f"new process / in-process second: {r['new_over_in_process']:.2f} "
        f"(goal <= {r['goals']['new_over_in_process']}); disk: {r['disk_files']} files, "
        + (f"{per_token:,.0f} bytes per cached token " if per_token else "nothing written ")
        + f"(KV {r['kv_bytes_per_token']:,} in {r['kv_dtype']}); start-up "
        f"{r['startup_seconds']['cold']:.1f} s / {r['startup_seconds']['new']:.1f} s"
    )
    con = console()
    con.print(t)
    con.print(f"wrote {path}")
    return 0


def _reuse_table(part: str, r: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{part}: questions over one document")
    for col in ("question", "TTFT s", "wall s", "cached / prompt tokens", "correct"):
        t.add_column(col, justify="right")
    for kind in ("session", "independent"):
        for i, a in enumerate(r[kind], 1):
            t.add_row(f"{kind} {i}", f"{a['ttft_seconds']:.1f}", f"{a['wall_seconds']:.1f}",
                      f"{a['cached_tokens']:,} / {a['prompt_tokens']:,}",
                      "yes" if a["correct"] else "no")
    later = r.get("ttft_later_over_first_max")
    ratio = r.get("session_over_independent")
    t.caption = (
        (f"TTFT of later questions / first: at most {later:.3f}; " if later is not None else "")
        + (f"session / independent requests: {ratio:.3f} (independent: mean of "
           f"{r['independent_measured']} measured)" if ratio is not None else "")
    )
    return t


def run_soak(args: argparse.Namespace) -> int:
    from pathlib import Path

    from declattn.bench.machine import machine_info
    from declattn.bench.soak import SoakConfig, write_report
    from declattn.bench.soak import run_soak as soak

    if args.seconds <= 0 or args.max_requests < 1 or args.clients < 1:
        raise UserError("--seconds, --max-requests and --clients must be positive")
    if args.rss_every <= 0 or args.long_tokens < 1:
        raise UserError("--rss-every and --long-tokens must be positive")
    cfg = SoakConfig(args.model, args.seconds, args.max_requests, args.clients, args.kv_blocks,
                     args.seed, rss_every_s=args.rss_every, long_tokens=args.long_tokens)
    err = console(stderr=True)
    result = soak(cfg, log=lambda m: err.print(f"[dim]{m}[/dim]"))
    result["machine"] = machine_info()
    path = write_report(result, Path(args.out))
    keys = ("requests", "served_2xx", "client_4xx", "server_5xx", "short_p50_seconds",
            "short_p95_seconds", "short_p50_during_long_seconds",
            "short_p95_during_long_seconds", "blocks_in_use_at_end", "preemptions",
            "server_rss_mb_before", "server_rss_mb_after_first_request", "server_rss_mb_after",
            "rss_growth_after_5_min")
    con = console()
    for k in keys:
        v = result[k]
        con.print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    con.print(f"wrote {path}")
    return 0 if result["server_5xx"] == 0 and result["blocks_in_use_at_end"] == 0 else 1

