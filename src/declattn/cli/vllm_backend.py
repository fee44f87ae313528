"""The ``--backend vllm`` branches of ``declattn run`` and ``declattn eval``: the same
requests served by vLLM with our plugin (``declattn.vllm``). vLLM is imported only here,
so every other command runs without it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from declattn.cli.common import UserError, console, focus_options


def run(args: Any, context: str, question: str) -> int:
    """The ``--backend vllm`` branch of ``declattn run``."""
    from declattn.da.options import model_da_defaults
    from declattn.vllm.offline import offline_env, served_model
    from declattn.vllm.run import run_arms, summary

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(
            "--backend vllm needs vLLM 0.32 in this environment (docs/vllm.md says how; "
            "`make test` builds one in .venv-vllm)"
        ) from e
    arms: tuple[str, ...] = ("da",)
    if args.vanilla:
        arms = ("vanilla",)
    elif args.no_mask:
        arms = ("da-nm",)
    elif args.compare:
        arms = ("da", "vanilla")
    dtype = "bfloat16" if args.dtype == "bf16" else "float32"
    offline_env()
    served = served_model(args.model)
    base = dataclasses.replace(model_da_defaults(served.directory), line_start=args.line_start)
    answers = run_arms(served, context, question, arms, options=focus_options(base, args),
                       max_tokens=args.max_tokens, dtype=dtype)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump([summary(a) for a in answers], f, indent=1, ensure_ascii=False)
    if args.json:
        print(json.dumps([summary(a) for a in answers], indent=1, ensure_ascii=False))
        return 0
    out = console()
    for a in answers:
        out.rule(f"{a.arm} response (vLLM)")
        out.print(a.text, markup=False, soft_wrap=True)
        out.print(f"[bold]{a.arm} answer:[/] {a.answer or '(no <answer> block)'}  "
                  f"[dim](finish: {a.finish_reason})[/]")
        if a.reads:
            read, full = a.blocks()
            out.print(f"KV blocks handed to vLLM's kernel over {len(a.reads)} decode steps: "
                      f"{read:,} of {full:,} ({read / full:.2f}x)")
        if a.report is not None and a.arm == "da" and not a.report["reads_restricted"]:
            out.print(f"[bold red]reads were NOT restricted:[/] {a.report}", soft_wrap=True)
    return 0


def evaluate(spec: Any, out_dir: Path, args: Any, judge: Any, con: Any,
            machine: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``--backend vllm`` branch of ``declattn eval``."""
    from declattn.vllm.eval_backend import check_arms, run_eval_vllm

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError("--backend vllm needs vLLM 0.32 in this environment (docs/vllm.md; "
                        "`make test` builds one in .venv-vllm)") from e
    if judge is not None:
        raise UserError("--judge-url runs with the engine backend: rerun the same command "
                        "without --backend vllm once the rows are written (it runs no model "
                        "for rows already there, it only judges them)")
    from declattn.vllm.offline import parse_llm_args

    try:
        check_arms(list(spec.arms))
        settings = parse_llm_args(args.vllm_arg)
    except ValueError as e:
        raise UserError(str(e)) from e
    if args.dtype is not None:
        settings.setdefault("dtype", {"bf16": "bfloat16", "fp32": "float32"}[args.dtype])
    t0 = time.perf_counter()
    rows = run_eval_vllm(spec, out_dir / "results.jsonl", machine=machine, settings=settings,
                         on_status=lambda text: con.print(f"[dim]{text}[/]"))
    con.print(f"vLLM backend: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    flagged = [r for r in rows if (r.get("vllm") or {}).get("reads_restricted") is False
               and r["arm"] != "da-nm"]
    if flagged:
        con.print(f"[bold red]{len(flagged)} DA rows were NOT restricted[/] (see their "
                  "\"vllm\" field; `declattn doctor` says why)")
    return rows
