"""The da-lora study's tables: the base model's results file (vanilla and a zero-shot DA
arm) and the trained model's (its own DA, the forced-wrong-chunk control, its vanilla)
side by side, every per-answer ratio against the **base** model's vanilla answer.

    declattn eval --model qwen2.5-0.5b --arms vanilla,da-economy ... --out runs/base
    declattn eval --model qwen2.5-0.5b-da --arms da-model,da-model-wrong,vanilla \\
        --chunk-target 512 --chunk-cap 640 ... --out runs/trained
    python scripts/da_lora_study.py runs/base/results.jsonl runs/trained/results.jsonl

Prints Markdown: one table per length with a row per arm and a column group per task
family (accuracy, focus covering the evidence's chunk), then the summary table of
``declattn eval`` (per answer vs vanilla: attended tokens, KV bytes, forwards, decode
seconds) over the relabelled rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from declattn.eval.metrics import group, summarize, vanilla_rows
from declattn.eval.report import markdown_table
from declattn.eval.runner import read_rows

BASE_LABELS = {"vanilla": "vanilla"}  # the reference: the base model's plain answer
TRAINED_LABELS = {"da-model": "da-trained", "da-model-wrong": "da-trained-wrong-chunk",
                  "vanilla": "plain-trained"}
"""Arm names after relabelling: DA arms keep a ``da`` prefix (the metrics score focus for
those), and only the base model's plain answers are ``vanilla``."""


def relabel(rows: list[dict], labels: dict[str, str], suffix: str) -> list[dict]:
    out = []
    for r in rows:
        arm = labels.get(r["arm"], f"{r['arm']}-{suffix}")
        out.append({**r, "arm": arm, "model": "study"})
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def family_table(rows: list[dict], length: int) -> str:
    fams = sorted({r["family"] for r in rows})
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    vanilla = vanilla_rows(rows)
    head = ["arm", *[f"{f} acc / focus on evidence / n" for f in fams], "declines"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = group([r for r in rows if r["length"] == length], "arm", "family")
    for arm in arms:
        cells, declines = [arm], 0.0
        for f in fams:
            rs = groups.get((arm, f), [])
            if not rs:
                cells.append("-")
                continue
            s = summarize(rs, vanilla)
            declines += (s.declines or 0) * s.n
            cells.append(f"{_pct(s.accuracy)} / {_pct(s.focus_covered)} / {s.n}")
        cells.append(f"{declines:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("trained", type=Path)
    args = p.parse_args()
    rows = relabel(read_rows(args.base), BASE_LABELS, "base") + relabel(
        read_rows(args.trained), TRAINED_LABELS, "trained")
    for length in sorted({r["length"] for r in rows}):
        print(f"\n### {length:,} tokens\n")
        print(family_table(rows, length))
    print("\n### Summary (per answer vs the base model's vanilla answer)\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
