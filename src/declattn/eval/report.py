"""The summary of a results file: one line per model, length and arm, as a rich table
and as JSON; both come from the rows alone. A conversation task's rows (they carry a
``turn``) also get one line per turn: accuracy, attended tokens against the vanilla arm's
on the same turn, prompt tokens taken from the prefix cache, prefill and wall seconds."""

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
        "no global",
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
            "no global": _pct(s.no_global_share),
            "declines": _num(s.declines, ".1f"),
            "fmt fail": _pct(s.format_failures),
            "runaway": _pct(s.runaways),
            "wall s": _num(s.wall_seconds, ".1f"),
        }
        t.add_row(*(cells[c] for c in cols))
    return t


def _reasons(s: Summary) -> str:
    """Declines per response, with their reasons summed over the group."""
    if s.declines is None:
        return "-"
    why = ", ".join(f"{k} {v}" for k, v in s.decline_reasons.items())
    return f"{s.declines:.1f}" + (f" ({why})" if why else "")


def summary_json(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per model, length and arm, then one per turn of the conversation tasks
    (those carry ``turn``)."""
    out = [{"model": m, "length": n, "arm": a, **s.to_dict()} for m, n, a, s in summaries(rows)]
    out += [
        {"model": m, "length": n, "turn": t, "arm": a, **s.to_dict()}
        for m, n, t, a, s in turn_summaries(rows)
    ]
    return out


def turn_summaries(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int, int, str, Summary]]:
    """``(model, length, turn, arm, summary)`` over the rows that are turns of a
    conversation, sorted by model, length, turn and arm run order."""
    turned = [r for r in rows if r.get("turn") is not None]
    groups = group(turned, "model", "length", "turn", "arm")
    rank = {a: i for i, a in enumerate(ORDER)}
    out = [(m, n, t, a, summarize(rs)) for (m, n, t, a), rs in groups.items()]
    return sorted(out, key=lambda x: (x[0], x[1], x[2], rank.get(x[3], 99)))


def _vs_vanilla(sums: list[tuple[str, int, int, str, Summary]]) -> dict[tuple, float | None]:
    """Each line's attended tokens per response over the vanilla arm's at the same model,
    length and turn (None without a vanilla line)."""
    vanilla = {(m, n, t): s.logical for m, n, t, a, s in sums if a == "vanilla"}
    out: dict[tuple, float | None] = {}
    for m, n, t, a, s in sums:
        base = vanilla.get((m, n, t))
        out[(m, n, t, a)] = s.logical / base if base and s.logical is not None else None
    return out


_TURN_COLUMNS = (
    "length", "turn", "arm", "n", "acc", "attended/resp", "vs vanilla", "saving", "prompt",
    "cached", "prefill s", "wall s",
)
_TURN_SHORT = {"length": "len", "attended/resp": "reads", "vs vanilla": "/vanilla",
               "saving": "saved", "prefill s": "prefill", "wall s": "s"}
"""Labels that fit the per-turn table in 100 columns."""


def _turn_cells(sums: list[tuple[str, int, int, str, Summary]]) -> list[list[str]]:
    ratio = _vs_vanilla(sums)
    out = []
    for m, n, t, a, s in sums:
        r = ratio[(m, n, t, a)]
        out.append([
            f"{n:,}",
            str(t),
            a,
            f"{s.n}" + (f"+{s.errors}err" if s.errors else ""),
            _pct(s.accuracy),
            _num(s.logical),
            "-" if r is None else f"{r:.2f}x",
            _pct(s.saving),
            _num(s.prompt_tokens),
            _num(s.cached_tokens),
            _num(s.prefill_seconds, ".2f"),
            _num(s.wall_seconds, ".1f"),
        ])
    return out


def turn_table(rows: Sequence[dict[str, Any]], title: str = "per turn") -> Table | None:
    """One line per length, turn and arm of the conversation tasks; None without any.
    ``vs vanilla``: attended tokens over the vanilla arm's on the same turn (each arm
    reads its own transcript); ``saving``: against full attention over the arm's own;
    ``cached``: prompt tokens the prefix cache supplied instead of a prefill."""
    sums = turn_summaries(rows)
    if not sums:
        return None
    t = Table(title=title)
    for c in _TURN_COLUMNS:
        t.add_column(_TURN_SHORT.get(c, c), justify="left" if c == "arm" else "right",
                     no_wrap=True)
    for cells in _turn_cells(sums):
        t.add_row(*cells)
    return t


def turn_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The per-turn lines as a Markdown table ("" without conversation rows)."""
    sums = turn_summaries(rows)
    if not sums:
        return ""
    head = ["model", *_TURN_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (m, *_), cells in zip(sums, _turn_cells(sums), strict=True):
        lines.append("| " + " | ".join([m, *cells]) + " |")
    return "\n".join(lines)


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
        "no global",
        "declines (reasons)",
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
            _pct(s.no_global_share),
            _reasons(s),
            _pct(s.format_failures),
            _pct(s.runaways),
            _num(s.wall_seconds, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    turns = turn_markdown(rows)
    if turns:
        lines += ["", "Per turn of the conversation tasks:", "", turns]
    return "\n".join(lines)
