"""``declattn doctor``: will DA really skip reads on this vLLM install, for this model?"""

from __future__ import annotations

import argparse
import json
from typing import Any

from declattn.cli.common import UserError, add_model_arg, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check what DA will really do on this vLLM install, for one model",
        description="Start vLLM (in this process) on the model with the settings you serve "
        "with, run one short DA probe request, and print which model runner vLLM chose, the "
        "attention backend of each KV-cache group, the CUDA-graph mode, and whether the "
        "kernel was really handed fewer blocks. Exit status 0 when DA is active, 1 when not.",
    )
    add_model_arg(p)
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
        help="a vllm.LLM keyword argument, VALUE read as JSON when it parses "
        "(e.g. async_scheduling=false, tensor_parallel_size=2, "
        "compilation_config='{\"cudagraph_mode\": \"PIECEWISE\"}'); repeatable",
    )
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="vLLM's max_model_len (the probe needs about 1,200 tokens)")
    p.add_argument("--no-probe", action="store_true", help="inspect only, run no request")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError("doctor needs vLLM 0.32 in this environment (docs/vllm.md; "
                        "`make test` builds one in .venv-vllm)") from e
    from declattn.vllm.doctor import run_doctor
    from declattn.vllm.offline import parse_llm_args

    try:
        settings = {"max_model_len": args.max_model_len, **parse_llm_args(args.vllm_arg)}
    except ValueError as e:
        raise UserError(str(e)) from e
    with user_errors():
        report = run_doctor(args.model, settings, probe=not args.no_probe)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0 if report.active else 1
    from rich.console import Console

    base = console()
    out = Console(width=max(base.width, 120), highlight=False, file=base.file, soft_wrap=True)
    out.rule("declattn doctor")
    out.print(f"vLLM {report.vllm}; model {report.model}")
    out.print(f"settings: {json.dumps(report.settings)}")
    for w in report.workers:
        out.print(f"[bold]worker {w.rank}[/]: model runner {w.runner.upper()}, "
                  f"cudagraph_mode {w.cudagraph_mode}, async scheduling "
                  f"{'on' if w.async_scheduling else 'off'}, tensor parallel "
                  f"{w.tensor_parallel}, DA processor {'loaded' if w.processor else 'MISSING'}")
        for g in w.groups:
            state = "DA skips" if g.ok else ("left alone" if g.by_design else "NOT restricted")
            line = (f"  KV-cache group {g.kv_cache_group}: {g.backend} ({g.builder}), "
                    f"{g.layers} layers, {g.spec}, block {g.block_size}: {state}")
            if not g.ok:
                line += f" ({g.reason})"
            if g.probe_steps:
                line += (f"; probe: {g.probe_blocks_read} of {g.probe_blocks_full} blocks "
                         f"over {g.probe_steps} steps")
            out.print(line, markup=False)
        for b in w.blockers:
            out.print(f"  blocker: {b['reason']}; fix: {b['fix']}", markup=False)
        for note in w.notes:
            out.print(f"  note: {note}", markup=False)
        if w.probe is not None:
            out.print(f"  probe: reads_restricted={w.probe['reads_restricted']}, "
                      f"{w.probe['restricted_steps']} of {w.probe['decode_steps']} decode "
                      f"steps compacted", markup=False)
    out.print(("[bold green]" if report.active else "[bold red]") + report.verdict() + "[/]")
    return 0 if report.active else 1
