"""The evaluation loop: samples x arms, one JSONL row per response, resumable.

Rows are appended and flushed one by one, so an interrupted run loses at most the
response in flight; a rerun with the same output file skips every key already present
(a half-written last line is cut off first). The sparse arms of a sample read their
budget from that sample's ``da`` row, whether it was written in this run or before.
A conversation task (``agentic``) is handed to ``conversation.turn_rows``: one row per
turn and arm, resumed turn by turn like the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from declattn.eval.arms import DA_ARMS, ArmRunner, ArmSettings, PromptTooLong, budget_from_da
from declattn.eval.controls import NoControl
from declattn.eval.conversation import turn_rows
from declattn.eval.judge import Judge
from declattn.eval.rows import build_row, error_row, row_key, sample_chunks
from declattn.eval.tasks import TaskData, generate, turns_of


@dataclass(frozen=True)
class EvalSpec:
    model: str
    tasks: Sequence[str]
    lengths: Sequence[int]
    arms: Sequence[str]
    samples: int
    seed: int = 0
    settings: ArmSettings = field(default_factory=ArmSettings)

    def units(self) -> Iterator[tuple[str, int, int]]:
        """``(task, length, sample index)`` in run order: lengths, then tasks, then samples."""
        for length in self.lengths:
            for task in self.tasks:
                for i in range(self.samples):
                    yield task, length, i

    @property
    def total(self) -> int:
        """Rows the spec makes: one per response, a conversation's one per turn."""
        responses = sum(turns_of(t) or 1 for t in self.tasks)
        return responses * len(self.lengths) * self.samples * len(self.arms)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file; a partial last line (an interrupted write) is dropped
    from the file, so appending continues on a clean line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    rows = []
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def run_eval(
    engine: Any,
    spec: EvalSpec,
    out: Path,
    *,
    machine: dict[str, Any],
    judge: Judge | None = None,
    on_row: Callable[[dict[str, Any], bool], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run what ``out`` lacks of ``spec`` and return all of ``spec``'s rows.

    ``on_row(row, resumed)`` is called for every row (``resumed``: it came from the file);
    ``on_status(text)`` says what is being done (generating, prefilling, an arm).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in read_rows(out)}
    # Built on first need, so a run with nothing left to do never touches the engine
    # (the CLI then reports without loading the model).
    data: TaskData | None = None
    runner: ArmRunner | None = None
    rows: list[dict[str, Any]] = []
    rejudged = False
    status = on_status or (lambda _text: None)
    with out.open("a", encoding="utf-8") as f:

        def keep(row: dict[str, Any], resumed: bool) -> None:
            """A row joins the results: a new one is judged, written and flushed at once."""
            nonlocal rejudged
            if resumed:
                rejudged |= _judge_row(judge, row)
            else:
                _judge_row(judge, row)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                done[row["key"]] = row
            rows.append(row)
            if on_row:
                on_row(row, resumed)

        for task, length, index in spec.units():
            turns = turns_of(task)
            keys = [
                row_key(spec.model, task, length, index, a, t)
                for a in spec.arms
                for t in (range(1, turns + 1) if turns else [None])
            ]
            if all(k in done for k in keys):
                for k in keys:
                    keep(done[k], True)
                continue
            status(f"{task} {length} #{index}: generating")
            if data is None or runner is None:
                data = TaskData.for_tokenizer(engine.tokenizer)
                runner = ArmRunner(engine, spec.settings)
            sample = generate(task, data, length, spec.seed + index)
            if turns:  # a conversation: one row per turn, each arm a conversation of its own
                for arm in spec.arms:
                    status(f"{task} {length} #{index}: {arm}, {turns} turns")
                    for row, resumed in turn_rows(
                        engine, spec.settings, sample, index, arm,
                        model=spec.model, done=done, machine=machine,
                    ):
                        if resumed:
                            _check_same_sample(row, sample)
                        keep(row, resumed)
                continue
            chunks: list | None = None
            for arm, key in zip(spec.arms, keys, strict=True):
                if key in done:
                    _check_same_sample(done[key], sample)
                    keep(done[key], True)
                    continue
                status(f"{task} {length} #{index}: {arm}")
                row = _run_one(engine, runner, spec, sample, index, arm, done, chunks, machine)
                if "chunks" in row and chunks is None:
                    chunks = _chunks_of(row, sample)
                keep(row, False)
    if rejudged:
        _rewrite(out, done.values())
    return rows


def _judge_row(judge: Judge | None, row: dict[str, Any]) -> bool:
    """Ask the judge about a row it has not seen; True when it was asked.

    A resumed row is judged too, so adding ``--judge-url`` to a finished run judges it
    without running the model again."""
    if judge is None or "error" in row or row.get("judge"):
        return False
    h = row["header"]
    row["judge"] = judge(h["question"], h["answers"], row["output"]["answer"])
    return True


def _rewrite(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Replace the results file at once, so an interruption leaves the old one whole."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _run_one(
    engine: Any,
    runner: ArmRunner,
    spec: EvalSpec,
    sample: Any,
    index: int,
    arm: str,
    done: dict[str, dict[str, Any]],
    chunks: list | None,
    machine: dict[str, Any],
) -> dict[str, Any]:
    budget = None
    mean = None
    if arm in ("streaming", "quest"):
        source = spec.settings.budget_arm
        da = done.get(row_key(spec.model, sample.task, sample.length, index, source))
        if da is None or "error" in da:
            why = f"the {source} arm failed" if da else f"no {source} row"
            return error_row(spec.model, sample, index, arm, f"no budget: {why}", machine)
        budget, mean = budget_from_da(da, spec.settings.sink)
    try:
        run = runner.run(arm, sample.context, sample.prompt_question(arm in DA_ARMS), budget,
                         sample.evidence)
    except PromptTooLong as e:
        why = e.hint(sample.length, engine.max_positions, spec.settings.max_tokens)
        return error_row(spec.model, sample, index, arm, why, machine)
    except NoControl as e:
        return error_row(spec.model, sample, index, arm, str(e), machine)
    s = spec.settings
    if chunks is None:
        chunks = sample_chunks(run, sample, engine.tokenizer, s.chunk_target, s.chunk_cap)
    row = build_row(run, sample, model=spec.model, index=index, chunks=chunks, machine=machine)
    if mean is not None:
        row["budget_da_mean_blocks"] = mean
    return row


def _chunks_of(row: dict[str, Any], sample: Any) -> list:
    from declattn.protocol.segment import Chunk

    return [Chunk(i, a, b, sample.context[a:b], t) for i, a, b, t in row["chunks"]]


def _check_same_sample(row: dict[str, Any], sample: Any) -> None:
    """A resumed row must come from the very context regenerated now."""
    if row["header"]["context_sha256"] != sample.context_sha256:
        raise RuntimeError(
            f"{row['key']}: the regenerated context differs from the one in the results "
            "file (another tokenizer or another version of the task generators?); "
            "use a new output directory"
        )
