"""The two pictures of an evaluation: accuracy against attended tokens (the Pareto
picture: up and to the left is better) and the read saving against context length."""

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
    """Fraction of full-attention reads avoided against context length, per arm."""
    sums = [s for s in summaries(rows) if s[3].n]
    models = sorted({m for m, *_ in sums})
    plt, fig, axes = _figure(max(1, len(models)))
    for ax, model in zip(axes, models, strict=False):
        for arm in _MARKERS:
            pts = sorted(
                (n, s.saving)
                for m, n, a, s in sums
                if m == model and a == arm and s.saving is not None
            )
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=_MARKERS[arm], label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("attended tokens saved vs full attention (%)")
        _frame(ax, model)
    return _save(plt, fig, path)


def _frame(ax: Any, model: str) -> None:
    """Both plots show percentages per model with the same frame."""
    ax.set_ylim(-5, 105)
    ax.set_title(model)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
