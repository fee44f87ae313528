"""The figure of ``declattn bench decode``: one panel per part that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

_COLOURS = {"global": "#444444", "focus": "#1f77b4", "local": "#2ca02c"}
MODES = tuple(_COLOURS)


def _micro_panels(ax_time: Any, ax_ratio: Any, micro: dict[str, Any]) -> None:
    rows = micro["contexts"]
    ctx = [r["context"] for r in rows]
    kernel = micro["contexts"][0]["arms"][0]["kernel"]  # the first path measured
    one = [a for a in rows[0]["arms"] if a["kernel"] == kernel]
    threads = min(a["threads"] for a in one)

    def arm(row: dict[str, Any], mode: str) -> dict[str, Any]:
        return next(
            a for a in row["arms"]
            if (a["kernel"], a["threads"], a["mode"]) == (kernel, threads, mode)
        )

    for mode, colour in _COLOURS.items():
        t = [arm(r, mode)["seconds_per_step"]["best"] * 1e3 for r in rows]
        roof = [arm(r, mode)["roofline_seconds_per_step"] * 1e3 for r in rows]
        ax_time.plot(ctx, t, "o-", color=colour, label=f"{mode} measured")
        ax_time.plot(ctx, roof, "x:", color=colour, label=f"{mode} bytes / read bandwidth")
    ax_time.set_xscale("log", base=2)
    ax_time.set_yscale("log")
    ax_time.set_xlabel("context (tokens)")
    ax_time.set_ylabel("ms per decode step (all layers)")
    ax_time.set_title(f"decode attention, {kernel}, {threads} thread(s), best of runs")
    ax_time.legend(fontsize=7)
    for mode in MODES:
        r = [arm(row, mode)["time_over_roofline_best"] for row in rows]
        ax_ratio.plot(ctx, r, "o-", color=_COLOURS[mode], label=mode)
    ax_ratio.axhline(1.0, color="grey", lw=0.8)
    ax_ratio.axhline(1.5, color="red", lw=0.8, ls="--", label="goal for focus steps")
    ax_ratio.set_xscale("log", base=2)
    ax_ratio.set_xlabel("context (tokens)")
    ax_ratio.set_ylabel("time / (bytes / read bandwidth)")
    ax_ratio.set_title("cost of a step against its bytes")
    ax_ratio.legend(fontsize=7)


def _e2e_panel(ax: Any, e2e: dict[str, Any]) -> None:
    runs = e2e["runs"]
    labels = [f"{r['model'].split(' ')[0]}\n{r['prompt_tokens'] // 1024}K" for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["measured_ratio"] for r in runs], 0.4, label="measured")
    ax.bar(
        [i + 0.2 for i in x],
        [r["predicted_ratio_roofline"] for r in runs],
        0.4,
        label="roofline (bytes)",
    )
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("DA / vanilla decode time")
    ax.set_ylim(0, 1.1)
    ax.set_title("forced DA transcript, end to end")
    ax.legend(fontsize=7)


def _hf_panel(ax: Any, hf: dict[str, Any]) -> None:
    rows = hf["contexts"]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ours"]["decode_tokens_per_second"] for r in rows], 0.4,
           label="declattn")
    ax.bar([i + 0.2 for i in x], [r["transformers"]["decode_tokens_per_second"] for r in rows],
           0.4, label="transformers generate")
    ax.set_xticks(list(x), [f"{r['context'] // 1024}K" for r in rows])
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"{hf['model']} ({hf['dtype']})")
    ax.legend(fontsize=7)


def plot_result(result: dict[str, Any], path: Path) -> None:
    panels = []
    if "micro" in result:
        panels += ["micro_time", "micro_ratio"]
    if "e2e" in result:
        panels.append("e2e")
    if "hf" in result:
        panels.append("hf")
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.2), squeeze=False)
    ax = dict(zip(panels, axes[0], strict=False))
    if "micro" in result:
        _micro_panels(ax["micro_time"], ax["micro_ratio"], result["micro"])
    if "e2e" in result:
        _e2e_panel(ax["e2e"], result["e2e"])
    if "hf" in result:
        _hf_panel(ax["hf"], result["hf"])
    m = result["machine"]
    load = m["load_average"]
    fig.suptitle(
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} threads\n"
        f"torch {m['torch']}, {m['date']}, load {'?' if load is None else f'{load:.2f}'}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
