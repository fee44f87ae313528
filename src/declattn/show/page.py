"""The web page of one DA response: the text coloured by mode, beside the chunks it read.

The page is one self-contained HTML file: no external font, stylesheet, script or image,
so it opens the same offline, in a mail attachment or in a CI artefact viewer. Hovering
a focus span lights the chunks it read in CSS alone (``:has`` with ``:hover``/``:focus``);
clicking one (or its tag, or its row in the Focus table) pins that highlight, which takes
one small inline script. The script is a constant of this module: it only reads the
numeric ``data-focus``/``data-chunk`` attributes this module writes and toggles a class.
The output and the chunk texts come from a model and a user document and are only ever
escaped text, and the page's Content-Security-Policy allows no script but that one (by
its hash) and no network at all, so even a bug in the escaping could not run code.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from declattn.da.accounting import saving
from declattn.protocol.modes import Mode
from declattn.protocol.tags import Declaration
from declattn.show.view import MODE_COLORS, ShowFocus, ShowRecord

_PREVIEW_CHARS = 70
LIT_COLOR = "#00c2ff"
"""The pinned highlight (a click on a focus): a cyan used nowhere else on the page or in
the figure, so a screenshot can tell it from everything else."""
_LIT_BACKGROUND = "#d9f6ff"


@dataclass(frozen=True)
class TextSpan:
    """Characters ``[start, end)`` of the output: text read under ``mode``, or a tag."""

    start: int
    end: int
    mode: Mode
    focus_ids: tuple[int, ...] = ()
    tag: Declaration | None = None
    focus: int | None = None
    """Index in ``ShowRecord.focus`` of the focus tag this span is, or was read under."""


def mode_spans(rec: ShowRecord) -> list[TextSpan]:
    """The output cut at its declarations: text between tags carries the mode declared.

    This is the mode as written; the engine applies it from the next token on (the
    one-step lag), which the figure shows per step.
    """
    focus_at = {f.start: i for i, f in enumerate(rec.focus)}
    spans: list[TextSpan] = []
    cursor, mode, ids, focus = 0, Mode.GLOBAL, (), None
    for d in rec.declarations:
        if d.start < cursor:  # overlapping declarations: keep the first, as the reader did
            continue
        if d.start > cursor:
            spans.append(TextSpan(cursor, d.start, mode, ids, focus=focus))
        tag_focus = focus_at.get(d.start) if d.kind == "focus" else None
        spans.append(TextSpan(d.start, d.end, d.mode, d.focus_ids, tag=d, focus=tag_focus))
        cursor, mode, ids = d.end, d.mode, d.focus_ids
        focus = tag_focus if d.mode is Mode.FOCUS else None
    if cursor < len(rec.text):
        spans.append(TextSpan(cursor, len(rec.text), mode, ids, focus=focus))
    return spans


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _css(focused_ids: Iterable[int]) -> str:
    rules = [_BASE_CSS]
    for mode, color in MODE_COLORS.items():
        rules.append(
            f".mode-{mode}{{background:{color}24;border-bottom:2px solid {color};}}"
            f".swatch-{mode}{{background:{color};}}"
        )
    for cid in sorted(set(focused_ids)):
        rules.append(
            f'body:has(.mode-focus[data-chunk~="{cid}"]:is(:hover,:focus)) '
            f'#chunk-{cid}, body:has(.mode-focus[data-chunk~="{cid}"]:is(:hover,:focus)) '
            f"#cell-{cid}{{outline:3px solid {MODE_COLORS[Mode.FOCUS]};"
            f"background:{MODE_COLORS[Mode.FOCUS]}2e;}}"
        )
    rules.append(_LIT_CSS.replace("LIT_BG", _LIT_BACKGROUND).replace("LIT", LIT_COLOR))
    return "\n".join(rules)


# !important: the pinned highlight wins over the hover rules (which carry ids), since the
# pointer still rests on the span that was clicked.
_LIT_CSS = """
.response .lit,.tag.lit{outline:3px solid LIT!important;outline-offset:1px}
.chunk.lit{outline:4px solid LIT!important;background:LIT_BG!important}
.map a.lit{background:LIT!important;border-color:LIT!important;color:#fff!important}
tr.focus-row.lit td{background:LIT_BG}
"""

_BASE_CSS = """
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;
background:#fafafa}
header{padding:14px 22px;background:#fff;border-bottom:1px solid #ddd}
h1{font-size:19px;margin:0 0 6px}
h2{font-size:16px;margin:16px 0 8px}
.facts{display:flex;flex-wrap:wrap;gap:4px 22px;margin:0;font-size:13.5px}
.facts div{display:flex;gap:6px}.facts dt{color:#666}.facts dd{margin:0;font-weight:600}
table.modes{border-collapse:collapse;font-size:13px;margin-top:8px}
table.modes th,table.modes td{padding:2px 10px;text-align:right;border-bottom:1px solid #eee}
table.modes th:first-child,table.modes td:first-child{text-align:left}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;
vertical-align:-1px}
.declines{font-size:13.5px;margin:8px 0 0;padding-left:20px}
.declines code{background:#fde2e2;padding:0 3px}
main{display:grid;grid-template-columns:minmax(0,3fr) minmax(300px,2fr);gap:0}
.left{padding:6px 22px 30px}
.response{white-space:pre-wrap;word-wrap:break-word;background:#fff;border:1px solid #ddd;
border-radius:6px;padding:14px 16px;line-height:1.75}
.response .mode-focus{cursor:pointer}
.response .mode-focus:hover,.response .mode-focus:focus{outline:2px solid #2f9e44;
outline-offset:1px}
.tag{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em;opacity:.5}
.tag.declined{color:#b00000;text-decoration:line-through;opacity:.8}
.legend{font-size:13px;color:#444;margin:0 0 8px}
.legend span.item{margin-right:14px}
.answer{background:#fff;border:1px solid #ddd;border-left:4px solid #e0a800;padding:8px 12px;
white-space:pre-wrap}
.question{white-space:pre-wrap;color:#333}
figure{margin:16px 0 0}figure img{width:100%;border:1px solid #ddd;background:#fff}
aside{border-left:1px solid #ddd;background:#f3f3f5;padding:6px 16px 30px;position:sticky;top:0;
max-height:100vh;overflow:auto}
.map{display:flex;flex-wrap:wrap;gap:3px;margin-bottom:10px}
.map a{display:inline-block;min-width:26px;padding:1px 4px;text-align:center;font-size:12px;
border:1px solid #bbb;border-radius:3px;background:#fff;color:#333;text-decoration:none}
.map a.read{border-color:#2f9e44;color:#1b6e2f;font-weight:600}
.chunk{background:#fff;border:1px solid #ddd;border-radius:6px;margin:0 0 10px;padding:6px 10px}
.chunk h3{font-size:13.5px;margin:0 0 4px;display:flex;justify-content:space-between;gap:8px}
.chunk h3 .where{font-weight:400;color:#666}
.chunk .text{white-space:pre-wrap;word-wrap:break-word;font-size:12.5px;max-height:16em;
overflow:auto;color:#333}
.muted{color:#777}
.note{background:#fff4d6;border:1px solid #e0a800;padding:6px 10px;margin:8px 0 0;font-size:13.5px}
.focus-summary{margin:0 0 6px;font-weight:600}
table.focus{border-collapse:collapse;font-size:13px;width:100%;background:#fff;
border:1px solid #ddd}
table.focus th,table.focus td{padding:3px 8px;text-align:left;border-bottom:1px solid #eee;
vertical-align:top}
table.focus code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.92em}
tr.focus-row{cursor:pointer}tr.focus-row:hover td{background:#f0f7f1}
.held-yes{color:#1b6e2f;font-weight:600}.held-no{color:#b00000;font-weight:600}
.declined-reason{color:#b00000}
.tag.focus-tag{cursor:pointer}
"""


def _facts(rec: ShowRecord) -> str:
    t = rec.totals
    facts = [
        ("model", rec.model),
        ("arm", rec.arm),
        ("date", rec.date or "?"),
        ("prompt", f"{rec.prompt_tokens:,} tokens"),
        ("chunks", f"{len(rec.chunks)}"),
        ("block size", f"{rec.block_size}"),
        ("output", f"{len(rec.token_texts):,} tokens"),
        ("decode steps", f"{t.get('steps', len(rec.steps)):,}"),
        ("finish", rec.finish_reason or "?"),
        ("attended (logical)", f"{t.get('logical', 0):,}"),
        ("attended (physical)", f"{t.get('physical', 0):,}"),
        ("read in full", f"{t.get('vanilla_logical', 0):,}"),
        ("saved per step (vs the same reply read in full)",
         f"{_pct(rec.saving)} logical, {_pct(rec.physical_saving)} physical"),
        *_per_answer_facts(rec),
        ("declines", f"{len(rec.declines)}"),
        ("focus form", rec.focus_form or "?"),
    ]
    items = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in facts)
    note = f'<p class="note">{_e(rec.note)}</p>' if rec.note else ""
    return f'<dl class="facts">{items}</dl>{note}'


def _per_answer_facts(rec: ShowRecord) -> list[tuple[str, str]]:
    """The cost per answer against the plain reply, when its record was given."""
    p = rec.per_answer
    if p is None:
        return []
    return [(
        "per answer (vs the plain reply)",
        f"{p.attended:.2f}x attended tokens, {p.kv_bytes:.2f}x KV bytes, {p.forwards:.2f}x "
        f"forwards, {p.seconds:.2f}x decode seconds, {p.tokens:.2f}x reply tokens",
    )]


def _mode_table(rec: ShowRecord) -> str:
    rows = []
    for mode in Mode:
        row = rec.by_mode.get(str(mode))
        if not row or not row.get("steps"):
            continue
        van = row.get("vanilla_logical", 0)
        saved = _pct(saving(row.get("logical", 0), van)) if van else "-"
        rows.append(
            f'<tr class="row-{mode}"><td><span class="swatch swatch-{mode}"></span>{mode}</td>'
            f"<td>{row['steps']:,}</td><td>{row.get('logical', 0):,}</td>"
            f"<td>{row.get('physical', 0):,}</td><td>{van:,}</td><td>{saved}</td></tr>"
        )
    if not rows:
        return ""
    head = (
        "<tr><th>mode</th><th>steps</th><th>logical</th><th>physical</th>"
        "<th>read in full</th><th>saved per step</th></tr>"
    )
    return f'<table class="modes">{head}{"".join(rows)}</table>'


def _declines(rec: ShowRecord) -> str:
    if not rec.declines:
        return '<p class="muted">No declined declarations.</p>'
    items = []
    for d in rec.declines:
        step = rec.step_after_char(d.end)
        where = f"character {d.start}" + (f", from step {step}" if step is not None else "")
        items.append(
            f'<li class="decline"><code>{_e(d.tag)}</code> at {_e(where)}: '
            f'<span class="reason">{_e(d.declined)}</span> (stayed in global)</li>'
        )
    return f'<ul class="declines">{"".join(items)}</ul>'


def _ids(ids: Iterable[int]) -> str:
    return " ".join(str(i) for i in ids)


def _lit_ids(f: ShowFocus) -> tuple[int, ...]:
    """What a click on focus ``f`` lights: the chunks it was read from (none if declined)."""
    return () if f.declined else f.focus_ids


def _focus_attrs(rec: ShowRecord, index: int | None) -> str:
    """The attributes that make an element a click target for focus ``index``."""
    if index is None:
        return ""
    ids = _ids(_lit_ids(rec.focus[index]))
    return f' data-focus="{index}" data-chunk="{ids}" tabindex="0"'


def _span_html(rec: ShowRecord, s: TextSpan) -> str:
    text = _e(rec.text[s.start : s.end])
    if s.tag is not None:
        d = s.tag
        cls = "tag declined" if d.declined else "tag"
        tip = f"declined: {d.declined}" if d.declined else f"declares {d.mode}"
        if s.focus is not None:
            cls += " focus-tag"
            tip += " · click to light its chunks" if not d.declined else " · click for details"
        return (
            f'<span class="{cls}" data-kind="{_e(d.kind)}" data-start="{d.start}"'
            f'{_focus_attrs(rec, s.focus)} role="button" title="{_e(tip)}">{text}</span>'
        )
    attrs = f'class="mode-{s.mode}" data-mode="{s.mode}" data-start="{s.start}"'
    tip = f"{s.mode}"
    if s.mode is Mode.FOCUS:
        ids = _ids(s.focus_ids)
        if s.focus is not None:
            attrs += _focus_attrs(rec, s.focus)
        else:  # a record whose focus list lacks this declaration: hover only
            attrs += f' data-chunk="{ids}" tabindex="0"'
        tip = f"focus: reads chunk{'s' if len(s.focus_ids) > 1 else ''} {', '.join(ids.split())}"
    return f'<span {attrs} title="{_e(tip)}">{text}</span>'


def _held(f: ShowFocus) -> str:
    if f.declined:
        return '<span class="muted">&mdash; (nothing narrowed)</span>'
    if f.holds_evidence is None:
        return '<span class="muted">not known</span>'
    if f.holds_evidence:
        return '<span class="held-yes">held the evidence</span>'
    return '<span class="held-no">missed the evidence</span>'


def _focus_row(rec: ShowRecord, i: int, f: ShowFocus) -> str:
    asked = f"find “{_e(f.phrase)}”" if f.phrase is not None else "by chunk id"
    chunks = ", ".join(str(c) for c in f.focus_ids)
    resolved = f"chunk{'s' if len(f.focus_ids) > 1 else ''} {chunks}" if chunks else "none"
    match = _e(f.match) if f.match else ("by id" if f.phrase is None else "&mdash;")
    if f.declined:
        outcome = f'<span class="declined-reason">declined: {_e(f.declined)}</span>'
    else:
        outcome = "accepted"
    step = rec.step_after_char(f.end)
    where = f"char {f.start}" + (f", step {step}" if step is not None else "")
    return (
        f'<tr class="focus-row{" declined" if f.declined else ""}" id="focus-row-{i}"'
        f"{_focus_attrs(rec, i)}><td>{i + 1}</td><td><code>{_e(f.tag)}</code><br>"
        f'<span class="muted">{_e(where)}</span></td><td>{asked}</td>'
        f'<td class="resolved">{resolved}</td><td class="match">{match}</td>'
        f'<td class="outcome">{outcome}</td><td class="held">{_held(f)}</td></tr>'
    )


def _focus_section(rec: ShowRecord) -> str:
    """Every focus the model wrote: asked, resolved, how well, and whether it was right."""
    evidence = rec.evidence_chunks
    known = (
        f"The evidence is in chunk{'s' if len(evidence) != 1 else ''} "
        f"{', '.join(str(c) for c in evidence)}."
        if evidence
        else "Where the evidence is, the record does not say."
    )
    head = f'<p class="focus-summary">{_e(rec.focus_summary())}</p>'
    if not rec.focus:
        return f'<section id="focus"><h2>Focus</h2>{head}<p class="muted">{known}</p></section>'
    rows = "".join(_focus_row(rec, i, f) for i, f in enumerate(rec.focus))
    table = (
        '<table class="focus"><tr><th>#</th><th>tag</th><th>asked</th><th>resolved to</th>'
        f"<th>match</th><th>outcome</th><th>evidence</th></tr>{rows}</table>"
    )
    hint = "Click a row, or a focus tag in the response, to light the chunks it resolved to."
    return (
        f'<section id="focus"><h2>Focus</h2>{head}<p class="muted" style="margin:0 0 6px">'
        f"{known} {hint}</p>{table}</section>"
    )


def _chunk_panel(rec: ShowRecord, focused: set[int]) -> str:
    cells = "".join(
        f'<a id="cell-{c.id}" href="#chunk-{c.id}" class="{"read" if c.id in focused else ""}" '
        f'title="chunk {c.id}">{c.id}</a>'
        for c in rec.chunks
    )
    entries = []
    for c in rec.chunks:
        state = "focused" if c.id in focused else "not focused"
        if rec.evidence_chunks and c.id in rec.evidence_chunks:
            state += " · holds the evidence"
        preview = c.text[:_PREVIEW_CHARS].replace("\n", " ")
        entries.append(
            f'<section class="chunk" id="chunk-{c.id}" data-id="{c.id}">'
            f'<h3><span>chunk {c.id}</span><span class="where">tokens {c.span.start:,}'
            f"&ndash;{c.span.end:,} · {c.tokens:,} tokens · {state}</span></h3>"
            f'<div class="text" title="{_e(preview)}">{_e(c.text)}</div></section>'
        )
    return (
        '<aside><h2>Magic chunks</h2><p class="muted" style="font-size:13px;margin:0 0 6px">'
        "Hover or tab to a green span to light up the chunks it read; click a focus to "
        "pin it.</p>"
        f'<nav class="map">{cells}</nav>{"".join(entries)}</aside>'
    )


SCRIPT = """
(function () {
  "use strict";
  var pinned = null;
  function clear() {
    document.querySelectorAll(".lit").forEach(function (e) { e.classList.remove("lit"); });
  }
  function pin(n, chunks) {
    clear();
    if (pinned === n) { pinned = null; return; }
    pinned = n;
    document.querySelectorAll('[data-focus="' + n + '"]').forEach(function (e) {
      e.classList.add("lit");
    });
    chunks.forEach(function (c) {
      ["chunk-", "cell-"].forEach(function (p) {
        var e = document.getElementById(p + c);
        if (e) { e.classList.add("lit"); }
      });
    });
    var first = chunks.length ? document.getElementById("chunk-" + chunks[0]) : null;
    if (first) { first.scrollIntoView({block: "nearest"}); }
  }
  function target(ev) {
    return ev.target instanceof Element ? ev.target.closest("[data-focus]") : null;
  }
  document.addEventListener("click", function (ev) {
    var el = target(ev);
    if (!el) { return; }
    var n = parseInt(el.getAttribute("data-focus"), 10);
    if (isNaN(n)) { return; }
    var chunks = (el.getAttribute("data-chunk") || "").split(" ").map(Number)
      .filter(function (c) { return c > 0; });
    pin(n, chunks);
  });
  document.addEventListener("keydown", function (ev) {
    var el = target(ev);
    if (el && (ev.key === "Enter" || ev.key === " ")) { ev.preventDefault(); el.click(); }
  });
})();
"""
"""The page's one script: a click on a ``data-focus`` element lights that focus's tag,
text and row and the chunks (panel entry and map cell) in its ``data-chunk``; a second
click on the same focus clears it. It reads only those numeric attributes."""

_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "script-src 'sha256-"
    + base64.b64encode(hashlib.sha256(SCRIPT.encode("utf-8")).digest()).decode("ascii")
    + "'"
)
"""No network, no script but ``SCRIPT`` (by its hash), inline styles and data: images."""


def render_page(rec: ShowRecord, figure_png: bytes | None = None) -> str:
    """The whole page as one HTML string; ``figure_png`` is embedded as a data URI."""
    spans = mode_spans(rec)
    focused = {i for s in spans if s.tag is None and s.mode is Mode.FOCUS for i in s.focus_ids}
    legend = "".join(
        f'<span class="item"><span class="swatch swatch-{m}"></span>{m}</span>' for m in Mode
    )
    response = "".join(_span_html(rec, s) for s in spans)
    answer = (
        f'<div class="answer">{_e(rec.answer)}</div>'
        if rec.answer is not None
        else '<p class="muted">The model wrote no &lt;answer&gt; block.</p>'
    )
    figure = ""
    if figure_png is not None:
        data = base64.b64encode(figure_png).decode("ascii")
        figure = (
            f'<figure><img alt="mode timeline, attended tokens and read map" '
            f'src="data:image/png;base64,{data}"></figure>'
        )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>declattn show · {_e(rec.model)} · {_e(rec.arm)}</title>"
        f"<style>{_css(focused)}</style></head><body>"
        f"<header><h1>Declarative attention: one response</h1>{_facts(rec)}"
        f"{_mode_table(rec)}{_declines(rec)}</header>"
        f'<main><div class="left">{_focus_section(rec)}'
        f'<h2>Question</h2><div class="question">{_e(rec.question)}</div>'
        f'<h2>Response</h2><div class="legend">{legend}'
        '<span class="item"><span class="tag">&lt;tag&gt;</span> declaration</span>'
        '<span class="item"><span class="tag declined">&lt;tag&gt;</span> declined</span>'
        f'</div><div class="response" id="response">{response}</div>'
        f"<h2>Answer</h2>{answer}{figure}</div>"
        f"{_chunk_panel(rec, focused)}</main><script>{SCRIPT}</script></body></html>\n"
    )


def save_page(rec: ShowRecord, path: str | Path, figure_png: bytes | None = None) -> Path:
    """Write the page (UTF-8); returns its path."""
    path = Path(path)
    path.write_text(render_page(rec, figure_png), encoding="utf-8")
    return path
