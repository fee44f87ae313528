"""``declattn doctor``: how this install runs a model. The engine's part (no vLLM needed):
which build of the native extension loaded and why, the CPU code of each native op, and the
model's decode route. Then, where vLLM is installed: will DA really skip reads there?"""

from __future__ import annotations

import argparse
import json
from typing import Any

from declattn.cli.common import UserError, add_model_arg, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check how the engine (and vLLM, where installed) will run one model",
        description="Print the native extension's build (CPU variant, where it was loaded "
        "from and why), the CPU code of each native op, and the model's decode route in "
        "declattn's engine. Then, where vLLM is installed: start it (in this process) on the "
        "model with the settings you serve with, run one short DA probe request, and print "
        "which model runner vLLM chose, the attention backend of each KV-cache group, the "
        "CUDA-graph mode, and whether the kernel was really handed fewer blocks. Exit status "
        "0 when DA is active (or vLLM is absent or skipped), 1 when not.",
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
    p.add_argument("--engine-only", action="store_true",
                   help="the engine's part only, even where vLLM is installed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def engine_report(model: str) -> dict[str, Any]:
    """The native build, its ops' CPU code, and ``model``'s decode route in the engine."""
    from declattn.api import Engine
    from declattn.engine import native

    lib = native.library()
    report: dict[str, Any] = {
        "native": None if lib is None else {
            "variant": lib.variant, "origin": lib.origin, "path": str(lib.path),
            "why": lib.why, "isa": list(lib.isa)},
        "ops": native.op_paths(),
    }
    try:
        with user_errors():
            route = Engine.from_pretrained(model).decode_route
    except UserError as e:  # a model only vLLM loads: the vLLM part still runs
        report["decode_route"] = {"kind": None, "why": f"not loadable here ({e})"}
    else:
        report["decode_route"] = {"kind": route.kind, "why": route.why}
    return report


def print_engine_report(report: dict[str, Any]) -> None:
    out = console()
    out.rule("declattn doctor: engine")
    lib = report["native"]
    if lib is None:
        out.print("native extension: unavailable (see the warning above); torch ops run")
    else:
        out.print(f"native extension: {lib['variant']} ({lib['origin']}: {lib['path']}); "
                  f"{lib['why']}", markup=False, soft_wrap=True)
    for op, path in report["ops"].items():
        out.print(f"  {op}: {path}", markup=False, soft_wrap=True)
    route = report["decode_route"]
    out.print(f"decode route: {route['kind'] or 'none'}: {route['why']}", markup=False,
              soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    engine = engine_report(args.model)
    try:
        import vllm  # noqa: F401
    except ImportError:
        vllm = None
    if vllm is None or args.engine_only:
        skipped = "--engine-only" if vllm is not None else "vLLM is not installed (docs/vllm.md)"
        if args.json:
            print(json.dumps({"engine": engine, "vllm": f"skipped: {skipped}"}, indent=1))
        else:
            print_engine_report(engine)
            console().print(f"vLLM checks skipped: {skipped}", markup=False, soft_wrap=True)
        return 0
    from declattn.vllm.doctor import run_doctor
    from declattn.vllm.offline import parse_llm_args

    try:
        settings = {"max_model_len": args.max_model_len, **parse_llm_args(args.vllm_arg)}
    except ValueError as e:
        raise UserError(str(e)) from e
    with user_errors():
        report = run_doctor(args.model, settings, probe=not args.no_probe)
    if args.json:
        print(json.dumps({"engine": engine, **report.to_dict()}, indent=1))
        return 0 if report.active else 1
    print_engine_report(engine)
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
