"""``declattn show``: a picture and a web page of one DA response, from its run record.

The run record (``declattn.show.record``) is a JSON dict written by one version of the
engine and read back here, possibly much later and by hand-edited or truncated files.
This module checks it once, turns it into small typed dataclasses, and gives both
renderers (``figure`` for the PNG, ``page`` for the HTML) the same reading of it: the
same mode colours, the same step at which a declaration took effect, the same savings.
A renderer never indexes the raw dict, so a bad record fails here with one clear
message rather than deep inside matplotlib or the HTML writer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from declattn.api.results import PerAnswer
from declattn.da.accounting import StepRecord, saving
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode
from declattn.protocol.tags import Declaration

__all__ = [
    "MODE_COLORS",
    "ShowChunk",
    "ShowFocus",
    "ShowRecord",
    "ShowStep",
    "not_a_da_record",
]

# One colour per mode, shared by the PNG and the HTML so the two read alike.
MODE_COLORS: dict[str, str] = {
    Mode.GLOBAL: "#2f6fdb",  # blue
    Mode.FOCUS: "#2f9e44",  # green
    Mode.LOCAL: "#c2189b",  # magenta
    Mode.ANSWER: "#e0a800",  # gold
}


@dataclass
class ShowStep(StepRecord):
    """One decode step as recorded (``StepRecord``: step ``index`` produced output token
    ``index``), with what the run record adds to it.

    ``blocks_read`` holds ``[first, last + 1)`` block ranges the attention actually
    gathered, or None where the record has no reads for the step (older engines).
    """

    blocks_read: tuple[tuple[int, int], ...] | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class ShowChunk:
    """A magic chunk: its token span in the prompt and its text."""

    id: int
    span: Span
    tokens: int
    text: str


@dataclass(frozen=True)
class ShowFocus:
    """One focus the model wrote and what came of it, from the record's ``focus`` list.

    ``focus_ids``: the chunks it resolved to, best match first; ``phrase`` and ``match``
    (``"exact"``/``"window"``) for a ``find`` focus, None for one by ids; ``declined``:
    why it was refused (nothing was narrowed then); ``holds_evidence``: whether those
    chunks hold what the question needs, None where the record does not know. ``start``
    and ``end`` are its tag's characters in the output, to link the two on the page.
    """

    start: int
    end: int
    tag: str
    phrase: str | None
    match: str | None
    focus_ids: tuple[int, ...]
    declined: str | None
    holds_evidence: bool | None

    @property
    def by(self) -> str:
        """How the model named the chunks: ``find`` (a phrase) or ``ids``."""
        return "find" if self.phrase is not None else "ids"


@dataclass(frozen=True)
class ShowRecord:
    """What the renderers need of a run record, checked."""

    model: str
    arm: str
    date: str
    question: str
    block_size: int
    prompt_tokens: int
    layout: Layout
    chunks: tuple[ShowChunk, ...]
    text: str
    answer: str | None
    finish_reason: str | None
    token_texts: tuple[str, ...]
    declarations: tuple[Declaration, ...]
    steps: tuple[ShowStep, ...]
    totals: dict[str, Any]
    by_mode: dict[str, dict[str, Any]]
    focus: tuple[ShowFocus, ...] = ()
    focus_form: str | None = None
    evidence_chunks: tuple[int, ...] | None = None
    note: str | None = None
    per_answer: PerAnswer | None = None
    """This reply against the plain reply to the same question, when its record was
    given (``declattn show --plain``); ``saving`` is per step, against the same reply
    read in full."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShowRecord:
        """Check and convert a record dict; ``ValueError`` names what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("not a DA run record (not a JSON object)")
        missing = [k for k in ("layout", "output", "block_size", "chunks", "steps") if k not in d]
        if missing:
            raise ValueError(not_a_da_record(d, missing))
        try:
            return _convert(d)
        except (KeyError, TypeError, ValueError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"malformed DA run record: {what}") from e

    @property
    def saving(self) -> float:
        """Per step: the fraction of logical reads avoided against the same reply read in
        full (DA vs DA-nm), over the decode steps."""
        return saving(self.totals.get("logical", 0), self.totals.get("vanilla_logical", 0))

    @property
    def physical_saving(self) -> float:
        return saving(self.totals.get("physical", 0), self.totals.get("vanilla_physical", 0))

    @property
    def declines(self) -> tuple[Declaration, ...]:
        return tuple(d for d in self.declarations if d.declined)

    def per_answer_line(self) -> str | None:
        """One line on the cost per answer (``PerAnswer.verdict``), if a plain record was
        given."""
        return None if self.per_answer is None else self.per_answer.verdict()

    def focus_summary(self) -> str:
        """One line on the focuses: how many were accepted and declined, and, where the
        record knows the evidence, how many of the accepted ones held it."""
        if not self.focus:
            return "focus: none declared"
        accepted = [f for f in self.focus if not f.declined]
        known = [f for f in accepted if f.holds_evidence is not None]
        if known:
            held = sum(1 for f in known if f.holds_evidence)
            parts = [f"{held} of {len(known)} held the evidence"]
            if len(known) < len(accepted):
                parts.append(f"{len(accepted) - len(known)} not known")
        else:
            unknown = " (evidence not known)" if accepted else ""
            parts = [f"{len(accepted)} accepted{unknown}"]
        declined = [f.declined for f in self.focus if f.declined]
        if declined:
            reasons = ", ".join(dict.fromkeys(str(r) for r in declined))
            parts.append(f"{len(declined)} declined ({reasons})")
        return "focus: " + "; ".join(parts)

    def step_after_char(self, end: int) -> int | None:
        """The first decode step that reads under a tag ending at character ``end``.

        The tag is complete once the token holding its last character is out; the step
        after that token's step reads under it (the engine's one-step lag). None when
        the response ended first.
        """
        if end <= 0:
            return 1
        ends = self._token_ends()
        token = bisect.bisect_left(ends, end)
        step = token + 1
        return step if step <= len(self.steps) else None

    def _token_ends(self) -> list[int]:
        ends, total = [], 0
        for t in self.token_texts:
            total += len(t)
            ends.append(total)
        return ends


def not_a_da_record(record: Any, missing: list[str]) -> str:
    """The message for a record without DA fields: most often a request that ran vanilla,
    whose ``note`` says why, so the note is quoted."""
    msg = f"not a DA run record (missing {', '.join(missing)})"
    note = record.get("note") if isinstance(record, dict) else None
    return f"{msg}; {note}" if note else msg


def _ranges(raw: Any) -> tuple[tuple[int, int], ...] | None:
    if raw is None:
        return None
    out = []
    for r in raw:
        first, stop = int(r[0]), int(r[1])
        if not 0 <= first <= stop:
            raise ValueError(f"bad block range {r}")
        out.append((first, stop))
    return tuple(out)


def _step(s: dict[str, Any]) -> ShowStep:
    seconds = s.get("seconds")
    return ShowStep(
        index=int(s["index"]),
        mode=Mode(s["mode"]),
        focus_ids=tuple(int(i) for i in s.get("focus_ids", ())),
        length=int(s["length"]),
        logical=int(s["logical"]),
        physical=int(s["physical"]),
        vanilla_logical=int(s["vanilla_logical"]),
        vanilla_physical=int(s["vanilla_physical"]),
        blocks_read=_ranges(s.get("blocks_read")),
        seconds=None if seconds is None else float(seconds),
    )


def _declaration(d: dict[str, Any], text_len: int) -> Declaration:
    start, end = int(d["start"]), int(d["end"])
    if not 0 <= start <= end <= text_len:
        raise ValueError(
            f"declaration {d.get('tag')!r} at characters {start}-{end} lies outside "
            f"the output text ({text_len} characters)"
        )
    return Declaration(
        kind=str(d["kind"]),
        start=start,
        end=end,
        tag=str(d["tag"]),
        focus_ids=tuple(int(i) for i in d.get("focus_ids", ())),
        mode=Mode(d["mode"]),
        declined=None if not d.get("declined") else str(d["declined"]),
    )


def _focus(
    raw: Any, declarations: list[Declaration], evidence: tuple[int, ...] | None
) -> tuple[ShowFocus, ...]:
    """The record's ``focus`` list, each entry tied to its declaration by ``start``.

    Records from before focus diagnostics have no list: their focus declarations are
    read instead (no phrase, no match), with ``holds_evidence`` from ``evidence_chunks``
    where the record names them.
    """
    tags = {d.start: d for d in declarations if d.kind == "focus"}
    if raw is None:
        raw = [
            {"start": d.start, "tag": d.tag, "focus_ids": d.focus_ids, "declined": d.declined}
            for d in tags.values()
        ]
    out = []
    for f in raw:
        start = int(f["start"])
        decl = tags.get(start)
        if decl is None:
            raise ValueError(f"focus at character {start} matches no focus declaration")
        ids = tuple(int(i) for i in f.get("focus_ids", ()))
        held = f.get("holds_evidence")
        if held is None and evidence is not None:
            held = bool(set(ids) & set(evidence))
        out.append(
            ShowFocus(
                start=start,
                end=decl.end,
                tag=str(f.get("tag", decl.tag)),
                phrase=None if f.get("phrase") is None else str(f["phrase"]),
                match=None if f.get("match") is None else str(f["match"]),
                focus_ids=ids,
                declined=None if not f.get("declined") else str(f["declined"]),
                holds_evidence=None if held is None else bool(held),
            )
        )
    return tuple(out)


def _convert(d: dict[str, Any]) -> ShowRecord:
    layout = Layout.from_dict(d["layout"])
    chunks = []
    for c in d["chunks"]:
        cid = int(c["id"])
        chunks.append(ShowChunk(cid, layout.chunk(cid), int(c["tokens"]), str(c["text"])))
    if len(chunks) != layout.n_chunks:
        raise ValueError(f"{len(chunks)} chunks listed but the layout has {layout.n_chunks}")
    out = d["output"]
    text = str(out["text"])
    token_texts = tuple(str(t) for t in out.get("token_texts", ()))
    declarations = sorted(
        (_declaration(x, len(text)) for x in d.get("declarations", ())), key=lambda x: x.start
    )
    steps = tuple(_step(s) for s in d["steps"])
    block_size = int(d["block_size"])
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    raw_evidence = d.get("evidence_chunks")
    evidence = None if raw_evidence is None else tuple(int(i) for i in raw_evidence)
    note = d.get("note")
    return ShowRecord(
        model=str(d.get("model", "?")),
        arm=str(d.get("arm", "da")),
        date=str(d.get("date", "")),
        question=str(d.get("question", "")),
        block_size=block_size,
        prompt_tokens=int(d.get("prompt_tokens", layout.prompt_len)),
        layout=layout,
        chunks=tuple(chunks),
        text=text,
        answer=out.get("answer"),
        finish_reason=out.get("finish_reason"),
        token_texts=token_texts,
        declarations=tuple(declarations),
        steps=steps,
        totals=dict(d.get("totals") or _sum_steps(steps)),
        by_mode=dict(d.get("by_mode") or {}),
        focus=_focus(d.get("focus"), declarations, evidence),
        focus_form=None if d.get("focus_form") is None else str(d["focus_form"]),
        evidence_chunks=evidence,
        note=None if note is None else str(note),
    )


def _sum_steps(steps: tuple[ShowStep, ...]) -> dict[str, Any]:
    fields = ("logical", "physical", "vanilla_logical", "vanilla_physical")
    sums = {f: sum(getattr(s, f) for s in steps) for f in fields}
    return {"steps": len(steps), **sums}
