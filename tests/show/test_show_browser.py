"""The ``declattn show`` page in a real headless Chromium: it renders, the focus
diagnostics are on screen, and a real mouse click on a focus lights the chunk it
resolved to, in the DOM and in a screenshot.

The page is the one ``write_show`` writes for a real ``focus="find"`` session's record
(conftest.py), opened from file://, with no network. Chromium comes from Debian's
packages (``make browser``); where it is absent, every test here skips, saying so.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from declattn.show import write_show
from declattn.show.page import LIT_COLOR

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no `chromium` on PATH: `make browser` installs Debian's, for the show page's "
    "headless-browser test",
)

VIEWPORT = (1400, 1000)
LIT = np.array(to_rgb(LIT_COLOR))


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[object]:
    from chromium_cdp import Browser

    root = tmp_path_factory.mktemp("chromium")
    with Browser(CHROMIUM, root / "profile", "about:blank", size=VIEWPORT) as b:
        yield b


def _write_page(record: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.json"
    path.write_text(json.dumps(record, ensure_ascii=False))
    return write_show(path).html


@pytest.fixture(scope="module")
def find_page(find_record_master, tmp_path_factory) -> Path:
    return _write_page(find_record_master, tmp_path_factory.mktemp("find"))


def _open(browser, page: Path):
    """Load ``page`` afresh (a click from an earlier test must not leak into this one)."""
    browser.js("window.__stale = true")
    browser.call("Page.navigate", url=page.as_uri())
    for _ in range(600):
        if browser.js("window.__stale === undefined && document.readyState === 'complete'"):
            return browser
        time.sleep(0.1)
    raise TimeoutError(f"{page} did not load")


def _pixels(png: bytes) -> np.ndarray:
    return imread(io.BytesIO(png), format="png")[..., :3]


def _lit_mask(img: np.ndarray) -> np.ndarray:
    return np.abs(img - LIT).sum(axis=-1) < 0.08


def _rect(browser, selector: str) -> dict:
    """The element's box in CSS pixels of the viewport, after scrolling it into view."""
    rect = browser.js(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
        " if (!e) return null; e.scrollIntoView({block: 'center'});"
        " const r = e.getBoundingClientRect();"
        " return {x: r.x, y: r.y, w: r.width, h: r.height}; })()"
    )
    assert rect is not None, f"no element {selector}"
    return rect


def _click(browser, selector: str) -> None:
    r = _rect(browser, selector)
    assert r["w"] > 0 and r["h"] > 0, f"{selector} has no box"
    x, y = r["x"] + min(r["w"] / 2, 12), r["y"] + r["h"] / 2
    hit = browser.js(
        f"document.elementFromPoint({x}, {y})"
        f".closest({json.dumps(selector)}) !== null"
    )
    assert hit, f"{selector} is covered at ({x}, {y})"
    browser.click(x, y)


def _lit(browser) -> list[str]:
    return browser.js("[...document.querySelectorAll('.lit')].map(e => e.id || e.className)")


def _lit_ids(browser) -> list[str]:
    return sorted(
        browser.js("[...document.querySelectorAll('.lit[id]')].map(e => e.id)")
    )


def test_page_renders_with_content(browser, find_page):
    b = _open(browser, find_page)
    assert b.js("document.title").startswith("declattn show")
    assert b.js("window.devicePixelRatio") == 1
    assert b.js("[innerWidth, innerHeight]") == list(VIEWPORT)
    # the embedded figure decoded (the page's policy allows data: images, nothing remote)
    assert b.js("document.querySelector('figure img').naturalWidth") == 1200
    assert b.js("document.querySelectorAll('.chunk').length") == 4
    img = _pixels(b.screenshot())
    assert img.shape[:2] == (VIEWPORT[1], VIEWPORT[0])
    non_white = (img < 0.9).any(axis=-1).mean()
    assert non_white > 0.05, "the screenshot is (nearly) blank"
    assert img.std() > 0.1
    # text was drawn: many dark pixels, in many distinct rows
    dark_rows = (img.mean(axis=-1) < 0.4).any(axis=1).sum()
    assert dark_rows > 150
    assert not _lit_mask(img).any(), "nothing is highlighted before a click"


def test_focus_diagnostics_are_visible(browser, find_page):
    b = _open(browser, find_page)
    r = _rect(b, "#focus")
    assert r["w"] > 400 and r["h"] > 100
    assert 0 <= r["y"] < VIEWPORT[1]
    text = b.js("document.getElementById('focus').innerText")
    assert "focus: 1 of 2 held the evidence; 1 declined (find phrase in no chunk)" in text
    assert "The evidence is in chunk 2." in text
    rows = b.js(
        "[...document.querySelectorAll('tr.focus-row')].map(r => "
        "[...r.cells].slice(2).map(c => c.innerText.trim()))"
    )
    assert rows == [
        ["find “Mary Hale”", "chunk 2", "exact", "accepted", "held the evidence"],
        ["find “board harbour”", "chunk 1", "window", "accepted", "missed the evidence"],
        ["find “submarine base”", "none", "—", "declined: find phrase in no chunk",
         "— (nothing narrowed)"],
    ]
    # each row is laid out and on top at its centre (not hidden or covered)
    for i in range(3):
        sel = f"#focus-row-{i}"
        box = _rect(b, sel)
        assert box["h"] > 10
        cx, cy = box["x"] + box["w"] / 2, box["y"] + box["h"] / 2
        assert b.js(f"document.elementFromPoint({cx}, {cy}).closest('{sel}') !== null")


def test_clicking_a_focus_tag_lights_its_chunk(browser, find_page):
    b = _open(browser, find_page)
    before = _pixels(b.screenshot())
    _click(b, '#response .tag[data-focus="0"]')
    assert _lit_ids(b) == ["cell-2", "chunk-2", "focus-row-0"]
    assert b.js("getComputedStyle(document.getElementById('chunk-2')).outlineColor") == (
        "rgb(0, 194, 255)"
    )
    chunk = b.js(
        "(() => { const r = document.getElementById('chunk-2').getBoundingClientRect();"
        " return [r.left, r.top, r.right, r.bottom]; })()"
    )
    assert chunk[1] >= 0 and chunk[3] <= VIEWPORT[1], "the lit chunk is scrolled into view"
    after = _pixels(b.screenshot())
    lit_before, lit_after = _lit_mask(before), _lit_mask(after)
    assert lit_before.sum() == 0
    assert lit_after.sum() > 1500, "the highlight colour is not on screen after the click"
    # most of it is chunk 2's frame in the panel (the rest: its map cell, the tag, the row)
    left, top, right, bottom = (int(round(v)) for v in chunk)
    inside = lit_after[max(0, top - 6) : bottom + 6, max(0, left - 6) : right + 6].sum()
    assert inside > 0.5 * lit_after.sum()
    assert inside > 2 * ((right - left) + (bottom - top))  # a frame all round, 4 px wide


def test_each_focus_lights_its_own_chunks_and_a_second_click_clears(browser, find_page):
    b = _open(browser, find_page)
    _click(b, '#response .tag[data-focus="1"]')  # "board harbour": chunk 1, by window
    assert _lit_ids(b) == ["cell-1", "chunk-1", "focus-row-1"]
    _click(b, '#response .mode-focus[data-focus="0"]')  # the text read under focus 0
    assert _lit_ids(b) == ["cell-2", "chunk-2", "focus-row-0"]
    _click(b, '#response .mode-focus[data-focus="0"]')
    assert _lit(b) == []
    # the declined find lights its row (the reason) and no chunk: nothing was narrowed
    _click(b, '#response .tag[data-focus="2"]')
    assert _lit_ids(b) == ["focus-row-2"]
    # a row of the Focus table is a click target too
    _click(b, "#focus-row-1")
    assert _lit_ids(b) == ["cell-1", "chunk-1", "focus-row-1"]


def test_keyboard_enter_on_a_focus_tag_lights_its_chunk(browser, find_page):
    b = _open(browser, find_page)
    b.js("document.querySelector('#response .tag[data-focus=\"0\"]').focus()")
    for kind in ("keyDown", "keyUp"):
        b.call(
            "Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
            windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "",
        )
    assert _lit_ids(b) == ["cell-2", "chunk-2", "focus-row-0"]


def test_an_old_ids_record_is_clickable_too(browser, record, tmp_path):
    page = _write_page(record, tmp_path / "old")
    b = _open(browser, page)
    assert "focus: 1 accepted (evidence not known)" in b.js(
        "document.getElementById('focus').innerText"
    )
    _click(b, '#response .tag[data-focus="0"]')  # <focus magic_chunks="2">
    assert _lit_ids(b) == ["cell-2", "chunk-2", "focus-row-0"]
