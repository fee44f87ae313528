"""The two pictures of an evaluation: accuracy against attended tokens (the Pareto
picture: up and to the left is better) and the savings against context length, per step
(against the same reply read in full) beside per answer (against the vanilla reply to
the same sample: attended tokens and decode seconds)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from declattn.eval.report import summaries

_MARKERS = {
    "vanilla": "o",
    "da-nm": "s",
    "da": "D",
    "da-constrained": "P",
    "da-find": "*",
    "da-find-constrained": "X",
    "da-find-index": "h",
    "da-economy": "p",
    "vanilla-chunks": "8",
    "streaming": "v",
    "quest": "^",
}


def _figure(n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    return plt, fig, axes[0]


def pareto_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Macro accuracy against mean attended tokens per decode step, one panel per model,
    one point per arm and length."""
    sums = [s for s in summaries(rows) if s[3].n]
    models = sorted({m for m, *_ in sums})
    plt, fig, axes = _figure(max(1, len(models)))
    for ax, model in zip(axes, models, strict=False):
        arms = [a for a in _MARKERS if any(m == model and x == a for m, _, x, _ in sums)]
        for arm in arms:
            pts = [
                (s.per_step, s.accuracy, n)
                for m, n, a, s in sums
                if m == model and a == arm and s.per_step is not None
            ]
            if not pts:
                continue
            ax.scatter(
                [p[0] for p in pts],
                [100 * (p[1] or 0) for p in pts],
                marker=_MARKERS[arm],
                s=60,
                label=arm,
            )
            for x, y, n in pts:
                ax.annotate(
                    f"{n // 1024}K" if n >= 1024 else str(n),
                    (x, 100 * (y or 0)),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
        xs = [s.per_step for m, _, _, s in sums if m == model and s.per_step]
        if xs and max(xs) > 10 * min(xs):  # log only where the reads span decades
            ax.set_xscale("log")
        ax.set_xlabel("attended tokens per decode step (mean, logical)")
        ax.set_ylabel("accuracy, macro over task families (%)")
        _frame(ax, model)
    return _save(plt, fig, path)


def savings_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Against context length, per model, three panels: per step, the fraction of reads
    saved against the same reply read in full; per answer, the reply's attended tokens
    and its decode seconds over the vanilla reply's (mean over samples; 1 is break-even)."""
    sums = [s for s in summaries(rows) if s[3].n]
    models = sorted({m for m, *_ in sums})
    plt, fig, axes = _figure(3 * max(1, len(models)))
    for i, model in enumerate(models):
        step_ax, reads_ax, time_ax = axes[3 * i : 3 * i + 3]
        for arm in _MARKERS:
            mine = sorted((n, s) for m, n, a, s in sums if m == model and a == arm)
            steps = [(n, 100 * s.saving) for n, s in mine if s.saving is not None]
            answers = [(n, s.per_answer.mean) for n, s in mine if s.per_answer is not None]
            _line(step_ax, steps, arm)
            _line(reads_ax, [(n, p.attended) for n, p in answers], arm)
            _line(time_ax, [(n, p.seconds) for n, p in answers], arm)
        _frame(step_ax, f"{model}: per step")
        step_ax.set_ylabel("reads saved vs the same reply read in full (%)")
        _frame_ratio(reads_ax, f"{model}: per answer vs vanilla, attended tokens")
        _frame_ratio(time_ax, f"{model}: per answer vs vanilla, decode seconds")
        for ax in (reads_ax, time_ax):
            ax.set_ylabel("the arm's reply / the vanilla reply (x)")
        for ax in (step_ax, reads_ax, time_ax):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
    return _save(plt, fig, path)


def _line(ax: Any, pts: list[tuple[int, float]], arm: str) -> None:
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_MARKERS[arm], label=arm)


def _frame_ratio(ax: Any, title: str) -> None:
    """A ratio panel: 1 (the vanilla reply's cost) drawn across."""
    ax.axhline(1.0, color="#555555", lw=0.8, ls="--")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _frame(ax: Any, title: str) -> None:
    """Both plots show percentages per model with the same frame."""
    ax.set_ylim(-5, 105)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
