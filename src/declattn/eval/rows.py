"""One JSONL row per response: everything the metrics, the table, the plots and the
roofline projection are computed from, so none of them needs the run again.

Steps are stored as lists under ``STEP_FIELDS`` (a 200-step response is a few KB). The
context itself is not stored: task, length and seed regenerate it, and its sha256 is
kept to prove a regeneration matches. A conversation (the agentic task) writes one row per
turn: its key ends in the turn, ``turn`` says which, and its header is the turn's own.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from declattn.api.session import DASession
from declattn.eval.arms import ArmRun
from declattn.eval.baselines import QuestSession
from declattn.eval.sample import Sample, evidence_chunks
from declattn.protocol.segment import segment, token_counter

ROW_VERSION = 1
STEP_FIELDS = (
    "mode",
    "focus_ids",
    "length",
    "logical",
    "physical",
    "vanilla_logical",
    "vanilla_physical",
    "blocks_read",
    "global_bytes",
    "sliding_bytes",
    "seconds",
)


def row_key(
    model: str, task: str, length: int, sample: int, arm: str, turn: int | None = None
) -> str:
    key = f"{model}|{task}|{length}|{sample}|{arm}"
    return key if turn is None else f"{key}|{turn}"


def sample_chunks(run: ArmRun, sample: Sample, tokenizer: Any, target: int, cap: int) -> list:
    """The magic chunks of the sample's context: the DA session's own, or the same cut
    made again for arms that do not segment (so every arm records the answer's chunks)."""
    if isinstance(run.session, DASession):
        return run.session.chunks
    return segment(sample.context, token_counter(tokenizer), target, cap)


def build_row(
    run: ArmRun,
    sample: Sample,
    *,
    model: str,
    index: int,
    chunks: list,
    machine: dict[str, Any],
    turn: int | None = None,
    header: dict[str, Any] | None = None,
    evidence: list[tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """``turn``, ``header`` and ``evidence`` (chunk ids per evidence span): a turn of a
    conversation, whose header and evidence are the turn's rather than the sample's."""
    sess, seq = run.session, run.seq
    reads = {r.index: r for r in seq.reads}
    steps = []
    for rec in sess.steps:
        read = reads.get(rec.index)
        steps.append(
            [
                str(rec.mode),
                list(rec.focus_ids),
                rec.length,
                rec.logical,
                rec.physical,
                rec.vanilla_logical,
                rec.vanilla_physical,
                len(read.blocks) if read else None,
                read.global_bytes if read else None,
                read.sliding_bytes if read else None,
                read.seconds if read else None,
            ]
        )
    is_da = isinstance(sess, DASession)
    answer = sess.answer
    row: dict[str, Any] = {
        **_head(model, sample, index, run.arm, turn, header),
        "prompt_tokens": len(seq.prompt_ids),
        "block_size": sess.block_size,
        "kv_dtype": run.kv_dtype,
        "max_tokens": seq.params.max_tokens,
        "chunks": [[c.id, c.start, c.end, c.tokens] for c in chunks],
        "evidence_chunks": [
            list(ids) for ids in (evidence_chunks(sample, chunks) if evidence is None else evidence)
        ],
        "budget_blocks": run.budget,
        "output": {
            "text": sess.text,
            "answer": answer if is_da else (answer or ""),
            "finish_reason": seq.finish_reason,
            "output_tokens": len(seq.output_ids),
        },
        "declarations": [d.to_dict() for d in sess.declarations] if is_da else [],
        "declines": [d.to_dict() for d in sess.declines] if is_da else [],
        "step_fields": list(STEP_FIELDS),
        "steps": steps,
        "totals": sess.accounting.totals(),
        "by_mode": {str(m): v for m, v in sess.accounting.by_mode().items()},
        # the per-answer figures' inputs: the decode forwards (model calls: a run of
        # forced tag text is one, while ``totals.steps`` counts a step per token), the KV
        # bytes they gathered, and ``timing.decode_seconds``
        "forwards": sum(1 for r in seq.reads if not r.forced),
        "kv_bytes": sum(r.global_bytes + r.sliding_bytes for r in seq.reads),
        "timing": {
            "prefill_seconds": seq.prefill_seconds,
            "cached_prompt_tokens": seq.cached_tokens,
            "decode_seconds": seq.decode_seconds,
            "wall_seconds": run.wall_seconds,
        },
        "machine": machine,
    }
    if is_da:
        row["layout"] = sess.layout.to_dict()
        row["prompt_style"] = sess.prompt.style
        guard = sess.runaway
        row["runaway"] = guard.to_dict() if guard is not None and guard.reason else None
    if isinstance(sess, QuestSession):
        row["quest_meta_bytes"] = sess.meta_bytes
    return row


def error_row(
    model: str,
    sample: Sample,
    index: int,
    arm: str,
    error: str,
    machine: dict[str, Any],
    turn: int | None = None,
    header: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A response that could not run (e.g. the prompt is longer than the model allows)."""
    return {**_head(model, sample, index, arm, turn, header), "error": error, "machine": machine}


def _head(
    model: str,
    sample: Sample,
    index: int,
    arm: str,
    turn: int | None,
    header: dict[str, Any] | None,
) -> dict[str, Any]:
    """What every row opens with: which response it is, and the sample's (or the turn's)
    header."""
    return {
        "version": ROW_VERSION,
        "key": row_key(model, sample.task, sample.length, index, arm, turn),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model,
        "arm": arm,
        "task": sample.task,
        "family": sample.family,
        "length": sample.length,
        "sample": index,
        "seed": sample.seed,
        **({} if turn is None else {"turn": turn}),
        "header": header if header is not None else sample.header(),
    }


def kv_bytes_of(row: dict[str, Any]) -> int:
    """The KV bytes a response's decode forwards gathered: the row's ``kv_bytes``, or its
    steps' bytes summed in rows written before it."""
    if "kv_bytes" in row:
        return int(row["kv_bytes"])
    return sum((s["global_bytes"] or 0) + (s["sliding_bytes"] or 0) for s in steps_of(row))


def steps_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's steps as dicts."""
    fields = row.get("step_fields", STEP_FIELDS)
    return [dict(zip(fields, s, strict=True)) for s in row.get("steps", [])]
