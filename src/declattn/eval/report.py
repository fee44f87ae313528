"""The summary of a results file: one line per model, length and arm, as a rich table
and as JSON; both come from the rows alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from declattn.eval.arms import ORDER
from declattn.eval.metrics import Summary, group, summarize


def summaries(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int, str, Summary]]:
    """``(model, length, arm, summary)`` sorted by model, length and arm run order."""
    groups = group(rows, "model", "length", "arm")
    out = [(m, n, a, summarize(rs)) for (m, n, a), rs in groups.items()]
    rank = {a: i for i, a in enumerate(ORDER)}
    return sorted(out, key=lambda t: (t[0], t[1], rank.get(t[2], 99)))


_SHORT_LABELS = {
    "length": "len",
    "attended/step": "reads/step",
    "saving": "saved",
    "covered": "cov",
    "fmt fail": "fmt",
    "wall s": "s",
}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_table(
    rows: Sequence[dict[str, Any]], title: str = "evaluation", *, compact: bool = False
) -> Table:
    """Every figure per model, length and arm; ``compact`` keeps the headline columns
    (for an 80-column terminal; ``summary.md`` and ``summary.json`` hold the rest)."""
    sums = summaries(rows)
    families = sorted({f for *_, s in sums for f in s.by_family})
    t = Table(title=title)
    full = [
        "model",
        "length",
        "arm",
        "n",
        "acc",
        *families,
        "EM",
        "F1",
        "attended/resp",
        "attended/step",
        "saving",
        "steps",
        "global",
        "focus",
        "on answer",
        "covered",
        "declines",
        "fmt fail",
        "runaway",
        "wall s",
    ]
    short = [
        "length",
        "arm",
        "n",
        "acc",
        "attended/step",
        "saving",
        "global",
        "covered",
        "fmt fail",
        "wall s",
    ]
    cols = short if compact else full
    judged = any(s.judge is not None for *_, s in sums)
    if judged:
        cols = [*cols[: cols.index("acc") + 1], "judge", *cols[cols.index("acc") + 1 :]]
    labels = _SHORT_LABELS if compact else {}
    for c in cols:
        t.add_column(
            labels.get(c, c), justify="left" if c in ("model", "arm") else "right", no_wrap=True
        )
    for model, length, arm, s in sums:
        cells = {
            "model": model,
            "length": f"{length:,}",
            "arm": arm,
            "n": f"{s.n}" + (f"+{s.errors}err" if s.errors else ""),
            "acc": _pct(s.accuracy),
            "judge": _pct(s.judge),
            **{f: _pct(s.by_family.get(f)) for f in families},
            "EM": _pct(s.exact_match),
            "F1": _pct(s.f1),
            "attended/resp": _num(s.logical),
            "attended/step": _num(s.per_step),
            "saving": _pct(s.saving),
            "steps": _num(s.decode_steps, ".0f"),
            "global": _pct(s.global_share),
            "focus": _num(s.focus_attempts, ".1f"),
            "on answer": _pct(s.focus_on_answer_rate),
            "covered": _pct(s.focus_covered),
            "declines": _num(s.declines, ".1f"),
            "fmt fail": _pct(s.format_failures),
            "runaway": _pct(s.runaways),
            "wall s": _num(s.wall_seconds, ".1f"),
        }
        t.add_row(*(cells[c] for c in cols))
    return t


def summary_json(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"model": m, "length": n, "arm": a, **s.to_dict()} for m, n, a, s in summaries(rows)]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The headline columns as a Markdown table, for notes and READMEs."""
    sums = summaries(rows)
    families = sorted({f for *_, s in sums for f in s.by_family})
    judged = any(s.judge is not None for *_, s in sums)
    head = [
        "model",
        "length",
        "arm",
        "n",
        "acc (macro)",
        "acc if format ignored",
        *(["judge"] if judged else []),
        *families,
        "attended/step",
        "saving",
        "global",
        "covered",
        "fmt fail",
        "runaway",
        "wall s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, length, arm, s in sums:
        cells = [
            model,
            f"{length:,}",
            arm,
            str(s.n),
            _pct(s.accuracy),
            _pct(s.lenient_accuracy),
            *([_pct(s.judge)] if judged else []),
            *[_pct(s.by_family.get(f)) for f in families],
            _num(s.per_step),
            _pct(s.saving),
            _pct(s.global_share),
            _pct(s.focus_covered),
            _pct(s.format_failures),
            _pct(s.runaways),
            _num(s.wall_seconds, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
