"""Per-response metrics computed from a results row, and their means by arm and family.

Everything here reads only the JSONL row, so a table can be rebuilt from a results file
(or a judge added) without running a model again. Accuracy is macro-averaged over task
families (each family counts once, however many tasks it has).

Two comparisons, never mixed: ``saving`` is per step (a reply's reads against the same
reply read in full, DA vs DA-nm); ``per_answer`` is per answer (a reply's attended
tokens, KV bytes, forwards and decode seconds over the vanilla arm's reply to the same
sample, ``PerAnswer``), what a user pays.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import fmean, median
from typing import Any

from declattn.api.results import PerAnswer, Stats
from declattn.da.accounting import saving
from declattn.eval.rows import kv_bytes_of, steps_of
from declattn.eval.scoring import score


@dataclass(frozen=True)
class RowMetrics:
    """One response's figures. Focus fields are ``None`` for arms that do not declare."""

    accuracy: float
    all_present: bool
    format_failure: bool
    exact_match: float | None
    f1: float | None
    judge: float | None
    logical: int
    physical: int
    vanilla_logical: int
    vanilla_physical: int
    decode_steps: int
    output_tokens: int
    logical_by_mode: dict[str, int]
    physical_by_mode: dict[str, int]
    global_share: float | None
    focus_attempts: int | None
    focus_accepted: int | None
    focus_on_answer: int | None
    focus_covered: bool | None
    declines: int | None
    runaway: bool
    wall_seconds: float
    decode_seconds: float
    lenient_accuracy: float = 0.0
    global_blocks: int | None = None  # accepted <global> blocks (DA arms)
    decline_reasons: dict[str, int] = field(default_factory=dict)
    match_quality: dict[str, int] = field(default_factory=dict)  # find focus: exact/window
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    prefill_seconds: float = 0.0
    kv_bytes: int = 0  # gathered by the decode forwards

    @property
    def saving(self) -> float:
        """Per step: logical reads avoided against full attention over the same
        transcript (the same reply read in full)."""
        return saving(self.logical, self.vanilla_logical)

    @property
    def per_step(self) -> float:
        return self.logical / self.decode_steps if self.decode_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["saving"] = self.saving
        return d


def prediction(row: dict[str, Any]) -> str | None:
    """The answer a row is scored on: DA arms' ``<answer>`` block (``None`` if absent),
    the whole response for the others."""
    return row["output"]["answer"]


def _focus(row: dict[str, Any]) -> tuple[int, int, int, bool | None]:
    focus = [d for d in row["declarations"] if d["kind"] == "focus"]
    accepted = [d for d in focus if d["declined"] is None]
    evidence = [set(ids) for ids in row.get("evidence_chunks", [])]
    wanted = set().union(*evidence) if evidence else set()
    on_answer = sum(1 for d in accepted if wanted & set(d["focus_ids"]))
    focused = set().union(*(set(d["focus_ids"]) for d in accepted)) if accepted else set()
    covered = all(e & focused for e in evidence) if evidence else None
    return len(focus), len(accepted), on_answer, covered


def row_metrics(row: dict[str, Any]) -> RowMetrics:
    s = score(prediction(row), row["header"])
    totals, by_mode = row["totals"], row["by_mode"]
    steps = steps_of(row)
    is_da = row["arm"].startswith("da")
    n_global = sum(1 for st in steps if st["mode"] == "global")
    attempts = accepted = on_answer = None
    covered = None
    if is_da:
        attempts, accepted, on_answer, covered = _focus(row)
    judge = row.get("judge")
    finish = row["output"]["finish_reason"] or ""
    return RowMetrics(
        accuracy=s.accuracy,
        all_present=s.all_present,
        format_failure=s.format_failure,
        exact_match=s.exact_match,
        f1=s.f1,
        judge=None if not judge else float(judge["verdict"]),
        logical=totals["logical"],
        physical=totals["physical"],
        vanilla_logical=totals["vanilla_logical"],
        vanilla_physical=totals["vanilla_physical"],
        decode_steps=totals["steps"],
        output_tokens=row["output"]["output_tokens"],
        logical_by_mode={m: v["logical"] for m, v in by_mode.items() if v["steps"]},
        physical_by_mode={m: v["physical"] for m, v in by_mode.items() if v["steps"]},
        global_share=(n_global / len(steps) if steps else None) if is_da else None,
        focus_attempts=attempts,
        focus_accepted=accepted,
        focus_on_answer=on_answer,
        focus_covered=covered,
        declines=len(row["declines"]) if is_da else None,
        runaway=finish.startswith("runaway"),
        wall_seconds=row["timing"]["wall_seconds"],
        decode_seconds=row["timing"]["decode_seconds"],
        lenient_accuracy=_lenient(row, s.accuracy),
        global_blocks=_count_kind(row, "global") if is_da else None,
        decline_reasons=_tally(d["declined"] for d in row["declines"]) if is_da else {},
        match_quality=_tally(
            d.get("match") for d in row["declarations"] if d["kind"] == "focus" and d.get("match")
        ),
        prompt_tokens=row.get("prompt_tokens", 0),
        cached_tokens=row["timing"].get("cached_prompt_tokens", 0),
        # rows written before the prefix cache timed a shared prefill instead
        prefill_seconds=row["timing"].get(
            "prefill_seconds", row["timing"].get("shared_prefill_seconds", 0.0)
        ),
        kv_bytes=kv_bytes_of(row),
    )


def row_stats(row: dict[str, Any]) -> Stats:
    """A row's counts as the ``Stats`` a live answer has, so the per-answer ratios have
    one definition (``PerAnswer.of``) in the eval and on the terminal alike."""
    t, timing = row["totals"], row["timing"]
    return Stats(
        prompt_tokens=row.get("prompt_tokens", 0),
        output_tokens=row["output"]["output_tokens"],
        decode_steps=row.get("forwards", t["steps"]),  # older rows: a step a token
        prefill_seconds=timing.get("prefill_seconds", 0.0),
        decode_seconds=timing["decode_seconds"],
        logical_attended=t["logical"],
        physical_attended=t["physical"],
        vanilla_attended=t["vanilla_logical"],
        vanilla_physical=t["vanilla_physical"],
        blocks_read=sum(s["blocks_read"] or 0 for s in steps_of(row)),
        bytes_read=kv_bytes_of(row),
        by_mode=row["by_mode"],
        cached_tokens=timing.get("cached_prompt_tokens", 0),
    )


def answer_key(row: dict[str, Any]) -> tuple:
    """Which answer a row is, whatever the arm: model, task, length, sample and turn."""
    return (row["model"], row["task"], row["length"], row["sample"], row.get("turn"))


def vanilla_rows(rows: Iterable[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The vanilla arm's rows that ran, by ``answer_key``: what per-answer figures divide
    by."""
    return {answer_key(r): r for r in rows if r["arm"] == "vanilla" and "error" not in r}


@dataclass(frozen=True)
class PerAnswerSummary:
    """An arm's cost per answer against the vanilla arm, over the ``n`` samples where
    both ran: the mean and the median of each ``PerAnswer`` ratio."""

    n: int
    mean: PerAnswer
    median: PerAnswer

    @classmethod
    def of(cls, ratios: Sequence[PerAnswer]) -> PerAnswerSummary | None:
        if not ratios:
            return None
        values = [asdict(r) for r in ratios]

        def each(f: Any) -> PerAnswer:
            return PerAnswer(**{k: f([v[k] for v in values]) for k in values[0]})

        return cls(len(ratios), each(fmean), each(median))


def per_answer(
    rows: Sequence[dict[str, Any]], vanilla: dict[tuple, dict[str, Any]]
) -> PerAnswerSummary | None:
    """``rows`` (one arm's) against the vanilla rows of the same samples."""
    ratios = [
        PerAnswer.of(row_stats(r), row_stats(vanilla[answer_key(r)]))
        for r in rows
        if "error" not in r and answer_key(r) in vanilla
    ]
    return PerAnswerSummary.of(ratios)


def _count_kind(row: dict[str, Any], kind: str) -> int:
    return sum(1 for d in row["declarations"] if d["kind"] == kind and d["declined"] is None)


def _tally(values: Iterable[str | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v is not None:
            out[v] = out.get(v, 0) + 1
    return out


def _lenient(row: dict[str, Any], strict: float) -> float:
    """A diagnostic, never the headline: a DA response without ``<answer>`` scored on its
    whole text. The gap to the strict accuracy is what the format costs."""
    if row["output"]["answer"] is not None:
        return strict
    return score(row["output"]["text"], row["header"]).accuracy


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return fmean(vals) if vals else None


@dataclass(frozen=True)
class Summary:
    """Means over the responses of one group (e.g. one model, length and arm)."""

    n: int
    errors: int
    accuracy: float | None  # macro over families
    by_family: dict[str, float]
    exact_match: float | None
    f1: float | None
    judge: float | None
    logical: float | None  # attended tokens per response
    physical: float | None
    per_step: float | None  # attended tokens per decode step
    saving: float | None
    decode_steps: float | None
    global_share: float | None
    focus_attempts: float | None
    focus_on_answer_rate: float | None
    focus_covered: float | None
    declines: float | None
    format_failures: float | None
    runaways: float | None
    wall_seconds: float | None
    logical_by_mode: dict[str, float] = field(default_factory=dict)  # mean per response
    lenient_accuracy: float | None = None  # macro, format failures scored on their text
    no_global_share: float | None = None  # DA replies that declared no <global> block
    decline_reasons: dict[str, int] = field(default_factory=dict)  # summed
    match_quality: dict[str, int] = field(default_factory=dict)  # find focus, summed
    prompt_tokens: float | None = None
    cached_tokens: float | None = None  # of the prompt, from the prefix cache
    prefill_seconds: float | None = None
    kv_bytes: float | None = None  # per response
    per_answer: PerAnswerSummary | None = None  # against vanilla, where it ran

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _by_mode(ms: Sequence[RowMetrics]) -> dict[str, float]:
    modes = sorted({m for x in ms for m in x.logical_by_mode})
    return {m: fmean(x.logical_by_mode.get(m, 0) for x in ms) for m in modes} if ms else {}


def summarize(
    rows: Sequence[dict[str, Any]], vanilla: dict[tuple, dict[str, Any]] | None = None
) -> Summary:
    """Means over ``rows``; ``vanilla`` (``vanilla_rows`` of the whole run) adds the cost
    per answer against the vanilla arm's rows of the same samples."""
    ok = [r for r in rows if "error" not in r]
    ms = [(r, row_metrics(r)) for r in ok]
    fam: dict[str, list[float]] = defaultdict(list)
    lenient: dict[str, list[float]] = defaultdict(list)
    for r, m in ms:
        fam[r["family"]].append(m.accuracy)
        lenient[r["family"]].append(m.lenient_accuracy)
    by_family = {f: fmean(v) for f, v in sorted(fam.items())}
    attempts = sum(m.focus_attempts or 0 for _, m in ms)
    on_answer = sum(m.focus_on_answer or 0 for _, m in ms)
    da = [m for _, m in ms if m.focus_attempts is not None]
    return Summary(
        n=len(ok),
        errors=len(rows) - len(ok),
        accuracy=fmean(by_family.values()) if by_family else None,
        by_family=by_family,
        exact_match=_mean(m.exact_match for _, m in ms),
        f1=_mean(m.f1 for _, m in ms),
        judge=_mean(m.judge for _, m in ms),
        logical=_mean(m.logical for _, m in ms),
        physical=_mean(m.physical for _, m in ms),
        per_step=_mean(m.per_step for _, m in ms if m.decode_steps),
        saving=_mean(m.saving for _, m in ms),
        decode_steps=_mean(m.decode_steps for _, m in ms),
        global_share=_mean(m.global_share for _, m in ms),
        focus_attempts=_mean(m.focus_attempts for m in da) if da else None,
        focus_on_answer_rate=on_answer / attempts if attempts else None,
        focus_covered=_mean(m.focus_covered for _, m in ms),
        declines=_mean(m.declines for _, m in ms),
        format_failures=_mean(m.format_failure for _, m in ms),
        runaways=_mean(m.runaway for _, m in ms),
        wall_seconds=_mean(m.wall_seconds for _, m in ms),
        logical_by_mode=_by_mode([m for _, m in ms]),
        lenient_accuracy=fmean(fmean(v) for v in lenient.values()) if lenient else None,
        no_global_share=_mean(m.global_blocks == 0 for m in da) if da else None,
        decline_reasons=_sum_tallies(m.decline_reasons for _, m in ms),
        match_quality=_sum_tallies(m.match_quality for _, m in ms),
        prompt_tokens=_mean(m.prompt_tokens for _, m in ms),
        cached_tokens=_mean(m.cached_tokens for _, m in ms),
        prefill_seconds=_mean(m.prefill_seconds for _, m in ms),
        kv_bytes=_mean(m.kv_bytes for _, m in ms),
        per_answer=per_answer(ok, vanilla) if vanilla else None,
    )


def _sum_tallies(tallies: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tallies:
        for k, v in t.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def group(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped by the values of ``keys``, in first-seen order."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
