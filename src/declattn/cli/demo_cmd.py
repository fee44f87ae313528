"""``declattn demo``: the main job — a DA answer over a long document, then the savings."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from declattn.cli.common import console, user_errors

FACT = "The keeper of the Gull Rock light wrote down the code {code} in her logbook."
QUESTION = "What code did the keeper of the Gull Rock light write down in her logbook?"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="the main job: a DA answer over a long document")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=6000, help="about how long the document is")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="out/demo", help="where the run record goes")
    p.set_defaults(func=run)


def planted_document(tokens: int, seed: int, count_tokens: Any) -> tuple[str, str]:
    """Paragraphs of the bundled essay, repeated to length, with one planted fact."""
    from declattn.bench.segment import sample_text

    paragraphs = [p for p in sample_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    doc: list[str] = []
    total = 0
    while total < tokens:
        para = paragraphs[len(doc) % len(paragraphs)]
        doc.append(para)
        total += count_tokens(para)
    code = str(rng.randint(1000, 9999))
    doc.insert(rng.randint(1, len(doc) - 1), FACT.format(code=code))
    return "\n\n".join(doc) + "\n", code


def run(args: argparse.Namespace) -> int:
    from declattn.api import Engine
    from declattn.cli.run_cmd import _report, _run_arm
    from declattn.session import token_counter

    out = console()
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = Engine.from_pretrained(args.model)
        context, code = planted_document(args.tokens, args.seed, token_counter(engine.tokenizer))
        out.print(
            f"document: {len(context):,} characters; planted code {code}; question: {QUESTION}"
        )
        ns = argparse.Namespace(
            model=args.model,
            max_tokens=args.max_tokens,
            line_start=False,
            json=False,
            save=str(Path(args.out) / "record.json"),
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)
        answers = {"da": _run_arm(engine, "da", context, QUESTION, ns, out)}
    _report(answers, ns, out, QUESTION)
    got = answers["da"].answer or ""
    out.print(f"planted code found in the answer: {'yes' if code in got else 'no'}")
    return 0
