"""The PNG of one DA response: mode timeline, attended tokens, and what each step read.

Three panels share the decode-step axis, so a mode change in the top band lines up
with the drop in attended tokens below it and with the chunk rows that went dark in
the heatmap. The heatmap is drawn from ``blocks_read``, the blocks the attention
actually gathered, not from the declared scope: it is the evidence that masking was
skipping, and a bug that reads the wrong chunk shows up as the wrong row.

Drawing uses matplotlib's object API on an Agg canvas, never ``pyplot``, so it sets no
global backend and keeps no figure registry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from declattn.protocol.layout import Span
from declattn.protocol.modes import Mode
from declattn.show.view import MODE_COLORS, ShowRecord, ShowStep

FIGSIZE = (12.0, 8.0)  # inches; at dpi 100 the PNG is 1200 x 800 pixels
_DECLINE_COLOR = "#d00000"
_MAX_ROW_LABELS = 24


@dataclass(frozen=True)
class ReadMap:
    """Per region of the prompt (and the response), per step: the fraction of it read.

    ``fractions[r][k]`` is row ``labels[r]`` at decode step ``steps[k]``; NaN where the
    record has no reads for that step.
    """

    labels: tuple[str, ...]
    steps: tuple[int, ...]
    fractions: tuple[tuple[float, ...], ...]


def read_fraction(span: Span, ranges: Sequence[Sequence[int]], block_size: int) -> float:
    """How much of ``span`` (token positions) the block ranges cover, in [0, 1]."""
    if len(span) == 0:
        return math.nan
    covered = 0
    for first, stop in ranges:
        lo = max(span.start, first * block_size)
        hi = min(span.end, stop * block_size)
        covered += max(0, hi - lo)
    return min(1.0, covered / len(span))


def read_map(rec: ShowRecord) -> ReadMap:
    """Rows sink, chunk 1..N, question, response (prompt order); one column per step."""
    lay = rec.layout
    rows: list[tuple[str, Any]] = [("sink", lay.sink)]
    rows += [(f"chunk {c.id}", c.span) for c in rec.chunks]
    rows += [("question", lay.question), ("response", None)]
    fractions = []
    for _, span in rows:
        row = []
        for s in rec.steps:
            if s.blocks_read is None:
                row.append(math.nan)
                continue
            # the response grows: at step k it is positions [prompt_len, length)
            region = span or Span(lay.prompt_len, max(s.length, lay.prompt_len))
            row.append(read_fraction(region, s.blocks_read, rec.block_size))
        fractions.append(tuple(row))
    return ReadMap(
        labels=tuple(label for label, _ in rows),
        steps=tuple(s.index for s in rec.steps),
        fractions=tuple(fractions),
    )


@dataclass(frozen=True)
class ModeRun:
    """Consecutive decode steps ``[first, last]`` read under one mode and one focus set."""

    mode: Mode
    focus_ids: tuple[int, ...]
    first: int
    last: int


def mode_runs(steps: Sequence[ShowStep]) -> list[ModeRun]:
    runs: list[ModeRun] = []
    for s in steps:
        prev = runs[-1] if runs else None
        same = prev is not None and (prev.mode, prev.focus_ids) == (s.mode, s.focus_ids)
        if prev is not None and same and prev.last + 1 == s.index:
            runs[-1] = ModeRun(prev.mode, prev.focus_ids, prev.first, s.index)
        else:
            runs.append(ModeRun(s.mode, s.focus_ids, s.index, s.index))
    return runs


def title(rec: ShowRecord) -> str:
    """Model, arm, prompt, the saving per step, and the cost per answer if known."""
    head = (
        f"{rec.model} · {rec.arm} · prompt {rec.prompt_tokens:,} tokens in "
        f"{len(rec.chunks)} chunk{'s' if len(rec.chunks) != 1 else ''} · "
        f"{len(rec.steps)} decode steps · per step (vs the same reply read in full): "
        f"{rec.saving:.1%} saved logical, {rec.physical_saving:.1%} physical"
    )
    p = rec.per_answer
    if p is None:
        return head
    return (f"{head}\nper answer (vs the plain reply): {p.attended:.2f}x attended tokens, "
            f"{p.kv_bytes:.2f}x KV bytes, {p.seconds:.2f}x decode seconds")


def draw_figure(rec: ShowRecord, dpi: int = 100) -> Any:
    """The three-panel figure (a ``matplotlib.figure.Figure`` on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=dpi)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(
        3,
        2,
        left=0.075,
        right=0.94,
        top=0.91,
        bottom=0.075,
        width_ratios=[60, 1],
        height_ratios=[0.7, 2.2, 3.0],
        hspace=0.12,
        wspace=0.02,
    )
    ax_mode = fig.add_subplot(grid[0, 0])
    ax_att = fig.add_subplot(grid[1, 0], sharex=ax_mode)
    ax_map = fig.add_subplot(grid[2, 0], sharex=ax_mode)
    fig.suptitle(title(rec), fontsize=11)
    n = len(rec.steps)
    if n == 0:
        for ax in (ax_mode, ax_att, ax_map):
            ax.text(0.5, 0.5, "no decode steps", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        return fig
    _draw_modes(ax_mode, rec)
    lines = _draw_attended(ax_att, rec)
    ax_mode.add_artist(ax_mode.get_legend())
    ax_mode.legend(
        handles=lines,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(lines),
        fontsize=8,
        frameon=False,
        borderaxespad=0.3,
        handlelength=2.2,
    )
    image = _draw_map(ax_map, rec)
    cax = fig.add_subplot(grid[2, 1])
    bar = fig.colorbar(image, cax=cax)
    bar.set_label("fraction read", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    first, last = rec.steps[0].index, rec.steps[-1].index
    ax_mode.set_xlim(first - 0.5, last + 0.5)
    for ax in (ax_mode, ax_att):
        ax.tick_params(labelbottom=False)
    ax_map.set_xlabel("decode step (step k produces output token k)")
    return fig


def _draw_modes(ax: Any, rec: ShowRecord) -> None:
    from matplotlib.patches import Patch

    n = len(rec.steps)
    for run in mode_runs(rec.steps):
        width = run.last - run.first + 1
        ax.broken_barh(
            [(run.first - 0.5, width)], (0, 1), facecolors=MODE_COLORS[run.mode], linewidth=0
        )
        if run.mode is Mode.FOCUS:
            ids = ",".join(str(i) for i in run.focus_ids)
            label = f"chunk{'s' if len(run.focus_ids) > 1 else ''} {ids}"
            if width / n < 0.07:
                label = ids
            if width / n >= 0.012:
                ax.text(
                    run.first - 0.5 + width / 2,
                    0.5,
                    label,
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=8,
                    fontweight="bold",
                    clip_on=True,
                )
    declined_at = [rec.step_after_char(d.end) for d in rec.declines]
    declined_at = [s for s in declined_at if s is not None]
    if declined_at:
        ax.plot(
            declined_at,
            [0.8] * len(declined_at),
            linestyle="none",
            marker="v",
            color=_DECLINE_COLOR,
            markeredgecolor="white",
            markersize=9,
        )
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("mode", rotation=0, ha="right", va="center", fontsize=9)
    present = [m for m in Mode if any(s.mode == m for s in rec.steps)]
    handles = [Patch(color=MODE_COLORS[m], label=str(m)) for m in present]
    if declined_at:
        from matplotlib.lines import Line2D

        handles.append(
            Line2D([], [], linestyle="none", marker="v", color=_DECLINE_COLOR, label="declined")
        )
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        borderaxespad=0.3,
        handlelength=1.2,
    )


def _draw_attended(ax: Any, rec: ShowRecord) -> list[Any]:
    """Attended positions per step; returns the line handles for the shared legend row."""
    from matplotlib.ticker import FuncFormatter

    x = [s.index for s in rec.steps]
    logical = [s.logical for s in rec.steps]
    for run in mode_runs(rec.steps):
        lo, hi = run.first - x[0], run.last - x[0] + 1
        ax.fill_between(
            [run.first - 0.5, *x[lo:hi], run.last + 0.5],
            0,
            [logical[lo], *logical[lo:hi], logical[hi - 1]],
            step="mid",
            color=MODE_COLORS[run.mode],
            alpha=0.18,
            linewidth=0,
        )
    lines = [
        ax.plot(
            x,
            [s.vanilla_logical for s in rec.steps],
            "--",
            color="#555555",
            lw=1.2,
            label="the same reply read in full",
            drawstyle="steps-mid",
            zorder=4,
        )[0],
        ax.plot(
            x,
            [s.physical for s in rec.steps],
            color="#e8590c",
            lw=0.8,
            label="DA physical (whole blocks)",
            drawstyle="steps-mid",
        )[0],
        ax.plot(
            x,
            logical,
            color="#111111",
            lw=1.6,
            label="DA logical (kept tokens)",
            drawstyle="steps-mid",
        )[0],
    ]
    # headroom above vanilla for the sums, so the note never hides a line
    ax.set_ylim(bottom=0, top=max(s.vanilla_physical for s in rec.steps) * 1.22)
    ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.set_ylabel("attended KV positions", fontsize=9)
    ax.grid(axis="y", color="#dddddd", lw=0.6)
    t = rec.totals
    ax.text(
        0.995,
        0.97,
        f"summed over decode steps: DA {t.get('logical', 0):,} logical, "
        f"{t.get('physical', 0):,} physical; read in full {t.get('vanilla_logical', 0):,} "
        f"({rec.saving:.1%} saved per step)",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=8,
    )
    return lines


def _thousands(value: float, _pos: int) -> str:
    if abs(value) >= 10_000:
        return f"{value / 1000:,.0f}K"
    return f"{value:,.0f}"


def _row_edges(n_chunks: int) -> list[float]:
    """Row boundaries, top to bottom: sink, chunks, question, response.

    Chunks get one unit each; the three always-read rows get at least one unit and
    grow with the chunk count, so they stay visible (and labelled) beside 100 chunks.
    """
    fixed = max(1.0, n_chunks / 12)
    heights = [fixed, *([1.0] * n_chunks), fixed, fixed]
    edges = [0.0]
    for h in heights:
        edges.append(edges[-1] + h)
    return edges


def _draw_map(ax: Any, rec: ShowRecord) -> Any:
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    m = read_map(rec)
    data = np.ma.masked_invalid(np.array(m.fractions, dtype=float))
    cmap = LinearSegmentedColormap.from_list("read", ["#ffffff", "#33334d"])
    cmap = cmap.with_extremes(bad="#f4d6d6")
    n_chunks = len(rec.chunks)
    edges = _row_edges(n_chunks)
    x_edges = [m.steps[0] - 0.5, *(k + 0.5 for k in m.steps)]
    image = ax.pcolormesh(x_edges, edges, data, cmap=cmap, vmin=0.0, vmax=1.0, shading="flat")
    ax.set_ylim(edges[-1], edges[0])
    rows = list(range(len(m.labels)))
    if n_chunks + 3 > _MAX_ROW_LABELS:
        every = math.ceil(n_chunks / (_MAX_ROW_LABELS - 3))
        keep = {0, len(rows) - 2, len(rows) - 1}
        rows = [r for r in rows if r in keep or (r - 1) % every == 0]
    ax.set_yticks([(edges[r] + edges[r + 1]) / 2 for r in rows])
    ax.set_yticklabels([m.labels[r] for r in rows], fontsize=8)
    for boundary in (edges[1], edges[-3], edges[-2]):
        ax.axhline(boundary, color="#2f6fdb", lw=0.6, alpha=0.6)
    _mark_focus(ax, rec, edges)
    ax.set_ylabel("what the attention read", fontsize=9)
    if data.mask.all():
        ax.text(
            0.5,
            0.5,
            "no block reads in this record",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=9,
        )
    return image


def _mark_focus(ax: Any, rec: ShowRecord, edges: list[float]) -> None:
    """Frame, in focus green, the chunk rows each focus run resolved to: a dark cell
    inside the frame is a focus read as declared, a dark row outside it is a bug."""
    from matplotlib.patches import Rectangle

    rows = {c.id: r for r, c in enumerate(rec.chunks, start=1)}
    for run in mode_runs(rec.steps):
        if run.mode is not Mode.FOCUS:
            continue
        for cid in run.focus_ids:
            r = rows.get(cid)
            if r is None:
                continue
            ax.add_patch(
                Rectangle(
                    (run.first - 0.5, edges[r]),
                    run.last - run.first + 1,
                    edges[r + 1] - edges[r],
                    fill=False,
                    edgecolor=MODE_COLORS[Mode.FOCUS],
                    lw=2.0,
                    zorder=3,
                )
            )


def save_figure(rec: ShowRecord, path: str | Path, dpi: int = 100) -> Path:
    """Draw and write the PNG; returns its path."""
    path = Path(path)
    fig = draw_figure(rec, dpi=dpi)
    fig.savefig(path, dpi=dpi, format="png", facecolor="white")
    return path
