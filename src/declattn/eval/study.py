"""Two ``declattn eval`` runs read as one study: a base model's (its vanilla arm and a
zero-shot DA arm) and a model trained to declare (its own DA, the forced-wrong-chunk
control, its plain answers).

``declattn eval`` divides every per-answer figure by the *same model's* vanilla answer;
a trained model is judged against what a user runs without it, the *base* model's
plain answer. So the rows of both runs are relabelled into one table: only the base's
vanilla rows keep the name ``vanilla`` (what every per-answer ratio divides by), DA
arms keep a ``da`` prefix (the metrics score focus for those), and all rows share one
model name, so one answer key pairs a trained row with the base's vanilla row of the
same sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from declattn.eval.metrics import group, summarize, vanilla_rows
from declattn.eval.report import markdown_table

BASE_LABELS = {"vanilla": "vanilla"}
TRAINED_LABELS = {
    "da-model": "da-trained",
    "da-model-wrong": "da-trained-wrong-chunk",
    "vanilla": "plain-trained",
}
"""Arm names after relabelling; an arm not named here gets its run in brackets,
``da-economy (base)``."""


def relabel(rows: Sequence[dict[str, Any]], labels: dict[str, str], suffix: str) -> list[dict]:
    """``rows`` under the study's arm names, all under one model name."""
    return [
        {**r, "arm": labels.get(r["arm"], f"{r['arm']} ({suffix})"), "model": "study"}
        for r in rows
    ]


def study_rows(base: Sequence[dict], trained: Sequence[dict]) -> list[dict]:
    """The rows of both runs, relabelled (see the module doc)."""
    return relabel(base, BASE_LABELS, "base") + relabel(trained, TRAINED_LABELS, "trained")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def family_table(rows: Sequence[dict[str, Any]], length: int) -> str:
    """Per arm and task family at ``length``: accuracy, share of focus blocks covering
    the evidence's chunk, and samples; the declines summed over families."""
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


def study_markdown(base: Sequence[dict], trained: Sequence[dict]) -> str:
    """One family table per length, then ``declattn eval``'s summary table over the
    relabelled rows (per answer against the base model's vanilla answer)."""
    rows = study_rows(base, trained)
    parts = []
    for length in sorted({r["length"] for r in rows}):
        parts += [f"### {length:,} tokens", "", family_table(rows, length), ""]
    parts += ["### Summary (per answer vs the base model's vanilla answer)", "",
              markdown_table(rows)]
    return "\n".join(parts)
