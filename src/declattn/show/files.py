"""``declattn show``'s files: a run record read for showing, and the PNG and web page
written for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from declattn.show.figure import save_figure
from declattn.show.page import save_page
from declattn.show.record import load_record, per_answer
from declattn.show.view import ShowRecord


def load_show_record(path: str | Path, plain: str | Path | None = None) -> ShowRecord:
    """Read a run record file for showing; ``plain``: the record of the plain answer to
    the same question, which adds the cost per answer (``ShowRecord.per_answer``).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file that is
    not a DA run record (or a ``plain`` that is not a plain one), both with a message
    naming the file.
    """
    try:
        record = load_record(path)
    except TypeError as e:  # JSON that is a number or null: ``in`` fails on it
        raise ValueError(f"{path}: not a DA run record (not a JSON object)") from e
    try:
        rec = ShowRecord.from_dict(record)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if plain is None:
        return rec
    return dataclasses.replace(rec, per_answer=per_answer(record, plain))


@dataclass(frozen=True)
class ShowFiles:
    png: Path
    html: Path
    focus: str
    """The record's one-line focus summary (``ShowRecord.focus_summary``)."""
    per_answer: str | None = None
    """One line on the cost per answer, with a plain record (``ShowRecord.per_answer_line``)."""


def write_show(
    record_path: str | Path, out_dir: str | Path | None = None, plain: str | Path | None = None
) -> ShowFiles:
    """Write ``<stem>.png`` and ``<stem>.html`` for a record, next to it by default
    (``plain``: the plain answer's record, for the figures per answer).

    The page embeds the picture, so the HTML file alone is enough to share.
    """
    record_path = Path(record_path)
    rec = load_show_record(record_path, plain)
    out = Path(out_dir) if out_dir is not None else record_path.parent
    out.mkdir(parents=True, exist_ok=True)
    png = save_figure(rec, out / f"{record_path.stem}.png")
    html = save_page(rec, out / f"{record_path.stem}.html", figure_png=png.read_bytes())
    return ShowFiles(png=png, html=html, focus=rec.focus_summary(),
                     per_answer=rec.per_answer_line())
