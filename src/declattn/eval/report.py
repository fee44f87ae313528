"""The summary of a results file: one line per model, length and arm, as a rich table
and as JSON; both come from the rows alone. A conversation task's rows (they carry a
``turn``) also get one line per turn: accuracy, attended tokens against the vanilla arm's
on the same turn, prompt tokens taken from the prefix cache, prefill and wall seconds.

Two comparisons sit side by side, named so they are not confused: "per step" (the
reply's reads against the same reply read in full, DA vs DA-nm) and "per answer vs
vanilla" (the reply's attended tokens, KV bytes, forwards and decode seconds over the
vanilla arm's reply to the same sample; mean over samples, median beside it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table

from declattn.eval.arms import ORDER
from declattn.eval.metrics import Summary, group, summarize, vanilla_rows


def summaries(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int, str, Summary]]:
    """``(model, length, arm, summary)`` sorted by model, length and arm run order."""
    groups = group(rows, "model", "length", "arm")
    vanilla = vanilla_rows(rows)
    out = [(m, n, a, summarize(rs, vanilla)) for (m, n, a), rs in groups.items()]
    rank = {a: i for i, a in enumerate(ORDER)}
    return sorted(out, key=lambda t: (t[0], t[1], rank.get(t[2], 99)))


_SHORT_LABELS = {
    "length": "len",
    "attended/step": "reads/step",
    "covered": "cov",
    "fmt fail": "fmt",
    "wall s": "s",
}


_WRAPPED = {"per step", "per answer vs vanilla"}
"""Columns whose header may wrap (their figures are short), so the compact table fits."""


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _per_answer_cells(s: Summary) -> dict[str, str]:
    """The per-answer columns: each ratio's mean over the samples (median for reads)."""
    p = s.per_answer
    if p is None:
        return dict.fromkeys(
            ("per answer vs vanilla", "median", "KV bytes", "forwards", "decode s"), "-"
        )
    return {
        "per answer vs vanilla": _ratio(p.mean.attended),
        "median": _ratio(p.median.attended),
        "KV bytes": _ratio(p.mean.kv_bytes),
        "forwards": _ratio(p.mean.forwards),
        "decode s": _ratio(p.mean.seconds),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_table(
    rows: Sequence[dict[str, Any]], title: str = "evaluation", *, compact: bool = False
) -> Table:
    """Every figure per model, length and arm; ``compact`` keeps the headline columns
    (for an 80-column terminal; ``summary.md`` and ``summary.json`` hold the rest).
    "per step": reads saved against the same reply read in full; "per answer vs
    vanilla": attended tokens over the vanilla reply's to the same sample (mean; then
    the median, and the means of KV bytes, forwards and decode seconds)."""
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
        "per step",
        "per answer vs vanilla",
        "median",
        "KV bytes",
        "forwards",
        "decode s",
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
        "per step",
        "per answer vs vanilla",
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
            labels.get(c, c), justify="left" if c in ("model", "arm") else "right",
            no_wrap=c not in _WRAPPED,
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
            "per step": _pct(s.saving),
            **_per_answer_cells(s),
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
    vanilla = vanilla_rows(turned)
    out = [(m, n, t, a, summarize(rs, vanilla)) for (m, n, t, a), rs in groups.items()]
    return sorted(out, key=lambda x: (x[0], x[1], x[2], rank.get(x[3], 99)))


_TURN_COLUMNS = (
    "length", "turn", "arm", "n", "acc", "attended/resp", "per answer vs vanilla", "per step",
    "prompt", "cached", "prefill s", "wall s",
)
_TURN_SHORT = {"length": "len", "attended/resp": "reads", "per answer vs vanilla": "/vanilla",
               "prefill s": "prefill", "wall s": "s"}
"""Labels that fit the per-turn table in 100 columns."""


def _turn_cells(sums: list[tuple[str, int, int, str, Summary]]) -> list[list[str]]:
    out = []
    for _m, n, t, a, s in sums:
        out.append([
            f"{n:,}",
            str(t),
            a,
            f"{s.n}" + (f"+{s.errors}err" if s.errors else ""),
            _pct(s.accuracy),
            _num(s.logical),
            _per_answer_cells(s)["per answer vs vanilla"],
            _pct(s.saving),
            _num(s.prompt_tokens),
            _num(s.cached_tokens),
            _num(s.prefill_seconds, ".2f"),
            _num(s.wall_seconds, ".1f"),
        ])
    return out


def turn_table(rows: Sequence[dict[str, Any]], title: str = "per turn") -> Table | None:
    """One line per length, turn and arm of the conversation tasks; None without any.
    ``per answer vs vanilla``: attended tokens over the vanilla arm's on the same turn
    (each arm reads its own transcript; mean over samples); ``per step``: against full
    attention over the arm's own; ``cached``: prompt tokens the prefix cache supplied
    instead of a prefill."""
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


def _per_answer_markdown(s: Summary) -> list[str]:
    """Per answer vs vanilla: attended tokens (mean / median), KV bytes, forwards and
    decode seconds (mean / median each)."""
    p = s.per_answer
    if p is None:
        return ["-"] * 4
    mean, mid = asdict(p.mean), asdict(p.median)
    keys = ("attended", "kv_bytes", "forwards", "seconds")
    return [f"{_ratio(mean[k])} / {_ratio(mid[k])}" for k in keys]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The headline columns as a Markdown table, for notes and READMEs: "per step saved"
    against the same reply read in full, "per answer vs vanilla" against the vanilla
    reply to the same sample (mean / median over samples)."""
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
        "per step saved",
        "per answer vs vanilla: attended (mean / median)",
        "KV bytes",
        "forwards",
        "decode s",
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
            *_per_answer_markdown(s),
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
