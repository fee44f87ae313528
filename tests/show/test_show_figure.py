"""The PNG: it decodes, has the promised size, and its panels say what the record says."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from declattn.protocol.layout import Span
from declattn.protocol.modes import Mode
from declattn.show.figure import (
    FIGSIZE,
    draw_figure,
    mode_runs,
    read_fraction,
    read_map,
    save_figure,
    title,
)
from declattn.show.view import MODE_COLORS, ShowRecord


@pytest.fixture
def rec(record) -> ShowRecord:
    return ShowRecord.from_dict(record)


def _nearest_mode(pixel: np.ndarray) -> tuple[str, float]:
    best = min(MODE_COLORS, key=lambda m: np.abs(pixel[:3] - to_rgb(MODE_COLORS[m])).sum())
    return str(best), float(np.abs(pixel[:3] - to_rgb(MODE_COLORS[best])).sum())


def _drawn(rec: ShowRecord, path, dpi: int = 60) -> tuple[Any, np.ndarray]:
    """The figure, saved and read back as RGB, its canvas drawn so transforms hold."""
    fig = draw_figure(rec, dpi=dpi)
    fig.savefig(path, dpi=dpi, format="png", facecolor="white")
    fig.canvas.draw()
    return fig, imread(path)[..., :3]


def _row_ticks(ax: Any) -> dict[str, float]:
    """The read map's row label -> y of its centre."""
    return dict(zip([t.get_text() for t in ax.get_yticklabels()], ax.get_yticks(), strict=True))


def test_png_size_and_not_blank(rec, tmp_path):
    path = save_figure(rec, tmp_path / "r.png", dpi=50)
    img = imread(path)
    assert img.shape[:2] == (round(FIGSIZE[1] * 50), round(FIGSIZE[0] * 50))
    rgb = img[..., :3]
    non_white = (rgb < 0.95).any(axis=-1).mean()
    assert non_white > 0.1  # three panels of ink, not an empty canvas
    assert rgb.std() > 0.1


def test_timeline_colour_of_every_step_is_its_mode(rec, tmp_path):
    fig, img = _drawn(rec, tmp_path / "r.png")
    height = img.shape[0]
    timeline = fig.axes[0]
    seen = set()
    for step in rec.steps:
        x, y = timeline.transData.transform((step.index, 0.2))
        pixel = img[int(round(height - y)), int(round(x))]
        mode, distance = _nearest_mode(pixel)
        assert mode == step.mode, f"step {step.index}"
        assert distance < 0.05
        seen.add(mode)
    assert seen == {"global", "focus", "local", "answer"}


def test_mode_colours_only_in_the_timeline_band(rec, tmp_path):
    fig, img = _drawn(rec, tmp_path / "r.png")
    box = fig.axes[0].get_window_extent()
    h = img.shape[0]
    band = img[int(h - box.y1) + 2 : int(h - box.y0) - 2, int(box.x0) + 2 : int(box.x1) - 2]
    for mode in Mode:
        close = (np.abs(band - to_rgb(MODE_COLORS[mode])).sum(axis=-1) < 0.03).sum()
        assert close > 50, mode
    # the band is filled edge to edge: almost no background shows through
    white = (band > 0.97).all(axis=-1).mean()
    assert white < 0.05


def test_read_fraction_counts_partial_blocks():
    assert read_fraction(Span(20, 120), [(0, 26)], 16) == 1.0
    assert read_fraction(Span(20, 120), [(0, 1), (8, 16)], 16) == 0.0
    # chunk [256, 360) with blocks 22..26 read: positions 352..360 of it
    assert read_fraction(Span(256, 360), [(22, 26)], 16) == pytest.approx(8 / 104)
    assert math.isnan(read_fraction(Span(5, 5), [(0, 1)], 16))


def test_read_map_matches_positions_read(rec):
    m = read_map(rec)
    assert m.labels == ("sink", "chunk 1", "chunk 2", "chunk 3", "question", "response")
    assert m.steps == tuple(s.index for s in rec.steps)
    spans = [rec.layout.sink, *(c.span for c in rec.chunks), rec.layout.question]
    for k, step in enumerate(rec.steps):
        read = set()
        for first, stop in step.blocks_read:
            read.update(range(first * rec.block_size, stop * rec.block_size))
        regions = [*spans, Span(rec.layout.prompt_len, step.length)]
        for row, span in enumerate(regions):
            expected = len(read & set(range(span.start, span.end))) / len(span)
            assert m.fractions[row][k] == pytest.approx(expected)
        if step.mode is Mode.FOCUS:
            assert m.fractions[1 + step.focus_ids[0] - 1][k] == 1.0
            assert m.fractions[1][k] == 0.0  # chunk 1 not read while focused on chunk 2
        if step.mode in (Mode.LOCAL, Mode.ANSWER):
            assert m.fractions[1][k] == 0.0 and m.fractions[2][k] == 0.0
        # sink, question and response are read in every mode
        assert m.fractions[0][k] == m.fractions[4][k] == m.fractions[5][k] == 1.0


def test_steps_without_reads_become_gaps(record, tmp_path):
    for s in record["steps"][:3]:
        del s["blocks_read"]
    rec = ShowRecord.from_dict(record)
    m = read_map(rec)
    assert all(math.isnan(row[0]) for row in m.fractions)
    assert not any(math.isnan(row[5]) for row in m.fractions)
    assert imread(save_figure(rec, tmp_path / "gap.png", dpi=40)).shape[0] == 320


def test_mode_runs_group_consecutive_steps(rec):
    runs = mode_runs(rec.steps)
    assert [(r.mode, r.focus_ids) for r in runs] == [
        (Mode.GLOBAL, ()),
        (Mode.FOCUS, (2,)),
        (Mode.GLOBAL, ()),
        (Mode.LOCAL, ()),
        (Mode.GLOBAL, ()),
        (Mode.ANSWER, ()),
    ]
    assert runs[0].first == 1 and runs[-1].last == len(rec.steps)
    assert sum(r.last - r.first + 1 for r in runs) == len(rec.steps)


def test_title_names_model_arm_prompt_and_saving(rec):
    t = title(rec)
    assert "synthetic" in t and "da" in t and "400 tokens" in t
    assert f"{rec.saving:.1%}" in t and rec.saving > 0.3


def test_no_decode_steps_still_draws(record, tmp_path):
    record["steps"] = []
    record["output"]["token_texts"] = record["output"]["token_texts"][:1]
    rec = ShowRecord.from_dict(record)
    img = imread(save_figure(rec, tmp_path / "empty.png", dpi=40))
    assert img.shape[:2] == (320, 480)


def test_heatmap_pixels_follow_the_reads(rec, tmp_path):
    fig, img = _drawn(rec, tmp_path / "r.png")
    ax_map = fig.axes[2]
    rows = _row_ticks(ax_map)
    m = read_map(rec)
    for k, step in enumerate(rec.steps):
        for r, label in enumerate(m.labels):
            x, y = ax_map.transData.transform((step.index, rows[label]))
            brightness = img[int(round(img.shape[0] - y)), int(round(x))].mean()
            fraction = m.fractions[r][k]
            if fraction == 1.0:
                assert brightness < 0.35, (step.index, label)
            elif fraction == 0.0:
                assert brightness > 0.97, (step.index, label)
            else:  # a partly read chunk (block rounding) is a light grey
                assert 0.5 < brightness < 0.97, (step.index, label)


def test_focus_runs_frame_the_chunks_they_resolved_to(find_record, tmp_path):
    rec = ShowRecord.from_dict(find_record)
    fig, img = _drawn(rec, tmp_path / "f.png")
    ax_map = fig.axes[2]
    rows = _row_ticks(ax_map)
    green = np.array(to_rgb(MODE_COLORS[Mode.FOCUS]))
    focus_runs = [r for r in mode_runs(rec.steps) if r.mode is Mode.FOCUS]
    assert [r.focus_ids for r in focus_runs] == [(2,), (1,)]  # the two accepted finds
    h = img.shape[0]
    for run in focus_runs:
        for label, y in rows.items():
            if not label.startswith("chunk "):
                continue
            # the frame's left edge, at the row's centre
            x, y_px = ax_map.transData.transform((run.first - 0.5, y))
            row, col = int(round(h - y_px)), int(round(x))
            band = img[row, col - 1 : col + 2]
            is_green = (np.abs(band - green).sum(axis=-1) < 0.15).any()
            assert is_green == (int(label.split()[1]) in run.focus_ids), (run, label)
