"""The run record: everything a finished response needs to be shown, replayed or audited.

One JSON file per response: the chunks and layout, the output token by token, every
decode step's mode and what it read (as block ranges, to keep the file small), the
declarations, the timings and the answer's counts (``stats``: what the cost per answer
is computed from), and the DA options a replay needs (``options``). ``declattn replay``
and ``declattn show`` read it; a plain answer's record (``run --compare --save``) is
read for its ``stats`` only (``load_plain_stats``), to put DA's reply against it.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from declattn.api import Answer
from declattn.api.results import PerAnswer, Stats
from declattn.api.session import DASession
from declattn.show.view import not_a_da_record

RECORD_VERSION = 1


def block_ranges(blocks: tuple[int, ...] | list[int]) -> list[list[int]]:
    """Sorted block ids as ``[first, last + 1]`` ranges."""
    out: list[list[int]] = []
    for b in sorted(blocks):
        if out and out[-1][1] == b:
            out[-1][1] = b + 1
        else:
            out.append([b, b + 1])
    return out


def machine() -> dict[str, Any]:
    import os

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def focus_diagnostics(
    answer: Answer, evidence: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Every focus the model wrote: what it asked (ids or a find phrase), what it was
    resolved to, how well it matched, and, where the caller knows which chunks hold the
    evidence, whether the focus held it."""
    out = []
    for d in answer.declarations:
        if d.kind != "focus":
            continue
        item = {
            "start": d.start, "tag": d.tag, "phrase": d.phrase, "match": d.match,
            "focus_ids": list(d.focus_ids), "declined": d.declined,
        }
        if evidence is not None:
            item["holds_evidence"] = bool(set(d.focus_ids) & set(evidence))
        out.append(item)
    return out


def build_record(
    answer: Answer, *, model: str, question: str, evidence: Sequence[int] | None = None
) -> dict[str, Any]:
    """The run record of ``answer``; ``evidence``: ids of the chunks that hold what the
    question needs, when the caller knows them (planted facts, eval tasks)."""
    sess = answer.session
    reads = {r.index: r for r in answer.reads}
    steps = []
    for rec in sess.steps:
        d = rec.to_dict()
        read = reads.get(rec.index)
        if read is not None:
            d["blocks_read"] = block_ranges(read.blocks)
            d["seconds"] = read.seconds
        steps.append(d)
    s = answer.stats
    record: dict[str, Any] = {
        "version": RECORD_VERSION,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": model,
        "arm": answer.arm,
        "question": question,
        "block_size": sess.block_size,
        "prompt_tokens": s.prompt_tokens,
        "output": {
            "text": answer.text,
            "answer": answer.answer,
            "finish_reason": answer.finish_reason,
            "token_texts": answer.token_texts,
        },
        "declarations": [d.to_dict() for d in answer.declarations],
        "steps": steps,
        "totals": sess.accounting.totals(),
        "by_mode": {str(m): v for m, v in sess.accounting.by_mode().items()},
        "timings": {
            "prefill_seconds": s.prefill_seconds,
            "decode_seconds": s.decode_seconds,
        },
        "stats": dataclasses.asdict(s),
    }
    if isinstance(sess, DASession):
        record["options"] = options_of(sess)
        record["layout"] = sess.layout.to_dict()
        record["chunks"] = [
            {"id": c.id, "start": c.start, "end": c.end, "tokens": c.tokens, "text": c.text}
            for c in sess.chunks
        ]
        record["prompt_style"] = sess.prompt.style
        record["focus_form"] = sess.options.focus
        record["focus"] = focus_diagnostics(answer, evidence)
        if evidence is not None:
            record["evidence_chunks"] = sorted(evidence)
    if answer.note is not None:
        record["note"] = answer.note
    return record


def options_of(sess: DASession) -> dict[str, Any]:
    """The request's ``DAOptions`` as the record keeps them: every field but the
    instruction's text (the prompt already holds it), so a replay reads under the same
    rules (``line_start``, ``scaffold_local``) and a reader sees how the request ran."""
    return {k: v for k, v in dataclasses.asdict(sess.options).items() if k != "instruction"}


def save_record(record: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(record, ensure_ascii=False, indent=1))
    return path


def load_record(path: str | Path) -> dict[str, Any]:
    """Read a run record, with a clear error for a file that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such record file")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    missing = [k for k in ("layout", "output", "block_size") if k not in record]
    if missing:
        raise ValueError(f"{path}: {not_a_da_record(record, missing)}")
    return record



def load_plain_stats(path: str | Path) -> Stats:
    """The counts of a plain answer's record (``arm`` vanilla): the reply a DA reply is
    put against, per answer (``--plain``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such record file")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    arm = record.get("arm") if isinstance(record, dict) else None
    if arm != "vanilla":
        raise ValueError(f"{path}: not a plain answer's record (arm {arm!r}, not 'vanilla'): "
                         "give the vanilla record of `run --compare --save`")
    return stats_of(record, path)


def stats_of(record: dict[str, Any], where: str | Path = "record") -> Stats:
    """``Stats`` from a record's ``stats`` (records written before it have none)."""
    raw = record.get("stats")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the record has no per-answer counts (\"stats\"): it was "
                         "written before them; run the request again with --save")
    try:
        return Stats(**raw)
    except TypeError as e:
        raise ValueError(f"{where}: malformed \"stats\" ({e})") from e


def per_answer(da_record: dict[str, Any], plain_path: str | Path) -> PerAnswer:
    """A DA record's reply against the plain reply recorded at ``plain_path``."""
    return PerAnswer.of(stats_of(da_record), load_plain_stats(plain_path))
