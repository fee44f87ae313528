"""``declattn run``: answer a question over a document, DA on, and show what was read."""

from __future__ import annotations

import argparse
from typing import Any

from declattn.cli.answering import record_paths, report_answers, stream_arm, suffixed, summary
from declattn.cli.common import (
    UserError,
    add_dtype_arg,
    add_focus_args,
    add_kv_cache_args,
    add_model_arg,
    console,
    focus_options,
    kv_cache_kwargs,
    read_context,
    require_question,
    user_errors,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="answer a question over a document with DA")
    add_model_arg(p)
    p.add_argument("--context", required=True, help="a text file, or - for standard input")
    p.add_argument(
        "--question", action="append",
        help="the question; repeat it to ask several over one document (its prefill is "
        "paid once: the prefix cache keeps the document's KV)",
    )
    arm = p.add_mutually_exclusive_group()
    arm.add_argument("--vanilla", action="store_true", help="ordinary prompt, full attention")
    arm.add_argument("--no-mask", action="store_true", help="DA prompt without masking (DA-nm)")
    arm.add_argument(
        "--compare", action="store_true",
        help="run DA and the plain answer side by side: the cost per answer (DA's reply over "
        "the plain reply) beside the saving per step (against the same reply read in full)",
    )
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument(
        "--line-start", action="store_true", help="opening tags count only at line start"
    )
    add_focus_args(p)
    add_dtype_arg(p)
    p.add_argument(
        "--backend",
        choices=["engine", "vllm"],
        default="engine",
        help="our engine, or vLLM with the DA plugin (needs vLLM installed; docs/vllm.md)",
    )
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill each question's prompt anew (by default the document's KV "
                   "is reused across --question)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: one per core measured idle at the start)")
    p.add_argument("--save", help="write the run record (JSON) here (with --compare, one per "
                   "arm: NAME.da.json and NAME.vanilla.json)")
    add_kv_cache_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON, no streaming")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from declattn.api import Engine
    from declattn.engine.threads import use_threads

    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    # one thread per idle core unless told: a shared CPU thrashes otherwise
    threads = use_threads(args.threads)
    questions = [require_question(q) for q in (args.question or [None])]
    context = read_context(args.context)
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if getattr(args, "backend", "engine") == "vllm":
        from declattn.cli.vllm_backend import run as run_vllm

        if len(questions) > 1:
            raise UserError("--backend vllm takes one --question")
        with user_errors():
            return run_vllm(args, context, questions[0])
    out = console(stderr=args.json)
    out.print(f"[dim]{threads.line()}[/]")
    arms = ["vanilla"] if args.vanilla else ["da-nm"] if args.no_mask else ["da"]
    if args.compare:
        arms = ["da", "vanilla"]
    results = []
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(
                args.model, dtype=args.dtype, prefix_caching=not args.no_prefix_cache,
                **kv_cache_kwargs(args),
            )
        options = focus_options(
            dataclasses.replace(engine.da_defaults, line_start=args.line_start), args
        )
        doc = engine.open(context, options)
        for i, question in enumerate(questions, 1):
            if len(questions) > 1 and not args.json:
                out.rule(f"question {i}: {question}")
            answers = {a: stream_arm(doc, a, question, args, out) for a in arms}
            save = args.save and (suffixed(args.save, f"q{i}") if len(questions) > 1 else args.save)
            report_answers(answers, args, out, question, record_paths(save, arms))
            results.append({"question": question, **summary(answers)})
        out.print(f"decode route: {engine.decode_route.describe()}", markup=False, soft_wrap=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1,
                         ensure_ascii=False))
    return 0
