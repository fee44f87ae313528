"""The HTML page: escaped text, one element per mode span, the chunk panel, the declines."""

from __future__ import annotations

import base64
import hashlib
import html
import re
from html.parser import HTMLParser

import pytest

from declattn.protocol.modes import Mode
from declattn.show import ShowRecord
from declattn.show.page import SCRIPT, mode_spans, render_page


class _Collect(HTMLParser):
    """Elements with an id or a class, their attributes and the text inside each."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[dict] = []
        self.elements: list[dict] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "parents": list(self.stack)}
        if tag in ("meta", "img", "br"):
            self.elements.append(el)
            return
        self.stack.append(el)
        self.elements.append(el)

    def handle_endtag(self, tag):
        while self.stack:
            el = self.stack.pop()
            if el["tag"] == tag:
                break

    def handle_data(self, data):
        for el in self.stack:
            el["text"] += data


def _parse(page: str) -> _Collect:
    p = _Collect()
    p.feed(page)
    p.close()
    return p


def _by_id(p: _Collect, ident: str) -> dict:
    return next(e for e in p.elements if e["attrs"].get("id") == ident)


def _response_spans(p: _Collect) -> list[dict]:
    resp = _by_id(p, "response")
    return [e for e in p.elements if e["parents"] and e["parents"][-1] is resp]


@pytest.fixture
def rec(record) -> ShowRecord:
    return ShowRecord.from_dict(record)


@pytest.fixture
def page(rec) -> str:
    return render_page(rec)


def test_one_element_per_mode_span_with_class_and_chunks(rec, page):
    spans = _response_spans(_parse(page))
    got = [(e["attrs"]["class"], e["attrs"].get("data-chunk")) for e in spans]
    # worked out by hand from the token texts in conftest.py
    assert got == [
        ("mode-global", None),  # "Let me look.\n"
        ("tag focus-tag", "2"),  # <focus magic_chunks="2">
        ("mode-focus", "2"),  # " The keeper was Mary Hale."
        ("tag", None),  # </focus>
        ("mode-global", None),  # "\n"
        ("tag declined focus-tag", ""),  # <focus magic_chunks="9">: lights no chunk
        ("mode-global", None),  # " hmm\n"
        ("tag", None),  # <local>
        ("mode-local", None),  # " So 1903 a < b"
        ("tag", None),  # </local>
        ("tag", None),  # <answer>
        ("mode-answer", None),  # "Mary Hale & <script>..."
        ("tag", None),  # </answer>
    ]
    assert len(spans) == len(mode_spans(rec))
    assert spans[2]["text"] == " The keeper was Mary Hale."
    assert spans[8]["text"] == " So 1903 a < b"
    assert spans[5]["attrs"]["title"] == "declined: unknown chunk id · click for details"
    # the two focus declarations are click targets 0 and 1, and so is the text read under 0
    assert [e["attrs"].get("data-focus") for e in spans[:7]] == [
        None, "0", "0", None, None, "1", None
    ]


def test_response_text_is_the_output_escaped(rec, page):
    spans = _response_spans(_parse(page))
    assert "".join(e["text"] for e in spans) == rec.text
    assert html.escape(" Hale & <script>alert('out')</script>", quote=True) in page
    assert " a &lt; b" in page


def test_no_markup_from_the_record_survives(page):
    # the one script is the page's own constant; nothing from the record is markup
    assert page.lower().count("<script") == 1
    assert f"<script>{SCRIPT}</script>" in page
    assert "<b>" not in page and "<i>" not in page
    p = _parse(page)
    assert p.tags.count("script") == 1
    assert not {"b", "i", "iframe"} & set(p.tags)
    assert "&lt;script&gt;alert(&#x27;chunk&#x27;)&lt;/script&gt;" in page
    assert "Who kept the light &lt;i&gt;after&lt;/i&gt; 1903?" in page


def test_chunk_panel_lists_every_chunk_with_its_text(rec, page):
    p = _parse(page)
    for c in rec.chunks:
        el = _by_id(p, f"chunk-{c.id}")
        assert el["attrs"]["data-id"] == str(c.id)
        assert c.text in el["text"]
        assert f"tokens {c.span.start:,}–{c.span.end:,}" in el["text"]
        cell = _by_id(p, f"cell-{c.id}")
        assert cell["attrs"]["href"] == f"#chunk-{c.id}"
    assert "focused" in _by_id(p, "chunk-2")["text"]
    assert "not focused" in _by_id(p, "chunk-1")["text"]


def test_hover_rules_only_for_focused_chunks(page):
    style = re.search(r"<style>(.*)</style>", page, re.S).group(1)
    assert re.search(r'data-chunk~="2"\]:is\(:hover,:focus\)\) #chunk-2', style)
    assert 'data-chunk~="1"' not in style and 'data-chunk~="3"' not in style


def test_summary_and_declines(rec, page):
    p = _parse(page)
    declines = [e for e in p.elements if e["attrs"].get("class") == "decline"]
    assert len(declines) == 1
    text = declines[0]["text"]
    assert '<focus magic_chunks="9">' in text and "unknown chunk id" in text
    step = rec.step_after_char(rec.declines[0].end)
    assert f"from step {step}" in text
    header = next(e for e in p.elements if e["tag"] == "header")["text"]
    assert f"{rec.totals['logical']:,}" in header
    assert f"{rec.totals['vanilla_logical']:,}" in header
    assert f"{rec.saving:.1%} logical" in header
    rows = [e for e in p.elements if e["attrs"].get("class", "").startswith("row-")]
    assert [r["attrs"]["class"] for r in rows] == [f"row-{m}" for m in Mode]
    focus_row = rows[1]["text"]
    assert f"{rec.by_mode['focus']['logical']:,}" in focus_row


def test_page_is_self_contained_and_embeds_the_figure(rec):
    png = b"\x89PNG\r\n\x1a\nnot really"
    page = render_page(rec, figure_png=png)
    srcs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert srcs and all(s.startswith(("#", "data:")) for s in srcs)
    assert "http://" not in page and "https://" not in page
    img = next(e for e in _parse(page).elements if e["tag"] == "img")
    assert base64.b64decode(img["attrs"]["src"].split(",", 1)[1]) == png


def test_no_answer_block_is_said(record):
    record["output"]["answer"] = None
    page = render_page(ShowRecord.from_dict(record))
    assert "no &lt;answer&gt; block" in page


def test_step_after_char_matches_the_steps(rec):
    first_focus = next(s.index for s in rec.steps if s.mode is Mode.FOCUS)
    focus_tag = next(d for d in rec.declarations if d.kind == "focus" and not d.declined)
    assert rec.step_after_char(focus_tag.end) == first_focus
    first_local = next(s.index for s in rec.steps if s.mode is Mode.LOCAL)
    local_tag = next(d for d in rec.declarations if d.kind == "local")
    assert rec.step_after_char(local_tag.end) == first_local
    assert rec.step_after_char(len(rec.text)) is None  # the last token has no later step


def test_focus_section_lists_every_focus(find_record):
    rec = ShowRecord.from_dict(find_record)
    p = _parse(render_page(rec))
    section = _by_id(p, "focus")
    assert rec.focus_summary() in section["text"]
    assert "The evidence is in chunk 2." in section["text"]
    rows = [e for e in p.elements if e["attrs"].get("id", "").startswith("focus-row-")]
    assert [r["attrs"]["data-focus"] for r in rows] == ["0", "1", "2"]
    assert [r["attrs"]["data-chunk"] for r in rows] == ["2", "1", ""]  # declined: none
    cells = [
        {c["attrs"]["class"]: c["text"] for c in p.elements if c["parents"][-1:] == [r]
         and "class" in c["attrs"]}
        for r in rows
    ]
    assert [c["resolved"] for c in cells] == ["chunk 2", "chunk 1", "none"]
    assert [c["match"] for c in cells] == ["exact", "window", "—"]
    assert [c["outcome"] for c in cells] == [
        "accepted", "accepted", "declined: find phrase in no chunk"
    ]
    assert [c["held"] for c in cells] == [
        "held the evidence", "missed the evidence", "— (nothing narrowed)"
    ]
    assert 'find “Mary Hale”' in rows[0]["text"] and '<focus find="Mary Hale">' in rows[0]["text"]
    assert "holds the evidence" in _by_id(p, "chunk-2")["text"]
    assert "holds the evidence" not in _by_id(p, "chunk-1")["text"]


def test_focus_tags_in_the_response_are_click_targets(find_record):
    rec = ShowRecord.from_dict(find_record)
    spans = _response_spans(_parse(render_page(rec)))
    targets = [
        (e["attrs"]["class"], e["attrs"]["data-focus"], e["attrs"]["data-chunk"])
        for e in spans
        if "data-focus" in e["attrs"]
    ]
    assert targets == [
        ("tag focus-tag", "0", "2"),
        ("mode-focus", "0", "2"),  # "Mary Hale kept the light."
        ("tag focus-tag", "1", "1"),
        ("mode-focus", "1", "1"),  # "the board"
        ("tag declined focus-tag", "2", ""),
    ]


def test_the_policy_allows_exactly_the_pages_script(page):
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1)
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and "unsafe-eval" not in csp
    body = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    assert body == SCRIPT


def test_note_is_shown(record):
    record["note"] = "a note <with> markup"
    page = render_page(ShowRecord.from_dict(record))
    assert '<p class="note">a note &lt;with&gt; markup</p>' in page
