"""Rich tables shared by run, replay and demo."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.table import Table

from declattn.da.accounting import saving

MODE_STYLES = {
    "global": "bold blue",
    "focus": "bold green",
    "local": "magenta",
    "answer": "bold yellow",
    "vanilla": "white",
}


PER_STEP_CAPTION = "saved per step: against the same reply read in full (DA vs DA-nm)"


def attended_table(by_mode: dict[str, dict[str, int]], totals: dict[str, Any], title: str) -> Table:
    """Attended tokens per mode, with the saving per step: the reply against the same
    reply read in full. Never the saving per answer (``answering.per_answer_table``)."""
    table = Table(title=title, caption=PER_STEP_CAPTION)
    cols = ("mode", "steps", "attended (logical)", "attended (physical)", "read in full",
            "saved per step")
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, row in by_mode.items():
        if not row["steps"]:
            continue
        table.add_row(
            f"[{MODE_STYLES.get(mode, '')}]{mode}[/]",
            f"{row['steps']:,}",
            f"{row['logical']:,}",
            f"{row['physical']:,}",
            f"{row['vanilla_logical']:,}",
            _saving(row["logical"], row["vanilla_logical"]),
        )
    table.add_section()
    table.add_row(
        "total",
        f"{totals['steps']:,}",
        f"{totals['logical']:,}",
        f"{totals['physical']:,}",
        f"{totals['vanilla_logical']:,}",
        _saving(totals["logical"], totals["vanilla_logical"]),
    )
    return table


def _saving(da: int, vanilla: int) -> str:
    return f"{saving(da, vanilla):.1%}" if vanilla else "-"


def declarations_table(declarations: Iterable[dict[str, Any]]) -> Table | None:
    rows = list(declarations)
    if not rows:
        return None
    table = Table(title="declarations")
    for col in ("at char", "tag", "mode after", "declined"):
        table.add_column(col)
    for d in rows:
        table.add_row(str(d["start"]), d["tag"], d["mode"], d["declined"] or "")
    return table
