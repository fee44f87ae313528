"""The two new arms and the per-answer figures: ``da-economy`` and ``vanilla-chunks`` run
in one engine beside ``da`` and ``vanilla``; each arm's summary puts its replies against
the vanilla replies of the same samples (``PerAnswer``), beside the saving per step."""

from __future__ import annotations

from statistics import fmean, median

import pytest

from declattn.api.session import DASession, PlainSession
from declattn.da.options import DAOptions
from declattn.eval.arms import ArmRunner, ArmSettings, parse_arms
from declattn.eval.metrics import row_metrics, summarize, vanilla_rows
from declattn.eval.plots import savings_plot
from declattn.eval.report import markdown_table, summaries, summary_json, summary_table
from declattn.eval.rows import steps_of
from declattn.eval.runner import EvalSpec, run_eval

SETTINGS = ArmSettings(max_tokens=6, chunk_target=256, chunk_cap=320)


def test_the_new_arms_run_next_to_the_prompts_they_share():
    assert parse_arms("vanilla,vanilla-chunks,da-economy,da") == [
        "da", "da-economy", "vanilla-chunks", "vanilla"
    ]
    eco = SETTINGS.da_options("da-economy")
    assert eco == DAOptions.economy(target=256, cap=320, sink=16, min_context=0)


def test_vanilla_chunks_keeps_the_da_transcript_and_changes_only_the_final_turn(tiny_engine):
    runner = ArmRunner(tiny_engine, SETTINGS)
    context, question = "Harbour log, day one. " * 120, "How many boats?"
    da = runner.session("da", context, question, None)
    eco = runner.session("da-economy", context, question, None)
    plain = runner.session("vanilla-chunks", context, question, None)
    raw = runner.session("vanilla", context, question, None)
    assert isinstance(da, DASession) and isinstance(eco, DASession)
    assert type(plain) is PlainSession and eco.options.scaffold_local
    end = da.layout.chunks[-1].end  # the last chunk's end: the document turns
    assert plain.prompt_ids[:end] == da.prompt_ids[:end] == eco.prompt_ids[:end]
    assert plain.prompt_ids != da.prompt_ids and plain.prompt_ids[:end] != raw.prompt_ids[:end]


@pytest.fixture(scope="module")
def rows(tiny_engine, tmp_path_factory):
    spec = EvalSpec("tiny", ["niah_single_noise"], [1024],
                    parse_arms("da,da-economy,vanilla-chunks,vanilla"), 2, settings=SETTINGS)
    out = tmp_path_factory.mktemp("per-answer") / "results.jsonl"
    return run_eval(tiny_engine, spec, out, machine={})


def test_rows_carry_what_the_per_answer_figures_need(rows):
    assert [r["arm"] for r in rows] == ["da", "da-economy", "vanilla-chunks", "vanilla"] * 2
    for r in rows:
        assert "error" not in r
        steps = steps_of(r)
        assert r["kv_bytes"] == sum(s["global_bytes"] + s["sliding_bytes"] for s in steps) > 0
        assert r["timing"]["decode_seconds"] > 0 and r["totals"]["steps"] == len(steps)
    chunked = [r for r in rows if r["arm"] == "vanilla-chunks"]
    for r in chunked:  # after the DA arms: the chunk turns come from the prefix cache
        assert r["timing"]["cached_prompt_tokens"] > 0
        assert r["totals"]["logical"] == r["totals"]["vanilla_logical"]  # full reads
        assert "layout" not in r and r["output"]["answer"] == r["output"]["text"].strip()


def test_per_answer_is_each_sample_over_its_vanilla_reply_mean_and_median(rows):
    vanilla = vanilla_rows(rows)
    assert len(vanilla) == 2
    by_arm = {a: [r for r in rows if r["arm"] == a] for a in ("da", "vanilla", "da-economy")}
    van = by_arm["vanilla"]
    for arm in ("da", "da-economy"):
        mine = by_arm[arm]
        s = summarize(mine, vanilla)
        assert s.per_answer is not None and s.per_answer.n == 2
        pairs = list(zip(mine, van, strict=True))
        reads = [a["totals"]["logical"] / b["totals"]["logical"] for a, b in pairs]
        kv = [a["kv_bytes"] / b["kv_bytes"] for a, b in pairs]
        forwards = [a["forwards"] / b["forwards"] for a, b in pairs]
        secs = [a["timing"]["decode_seconds"] / b["timing"]["decode_seconds"] for a, b in pairs]
        assert s.per_answer.mean.attended == pytest.approx(fmean(reads))
        assert s.per_answer.median.attended == pytest.approx(median(reads))
        assert s.per_answer.mean.kv_bytes == pytest.approx(fmean(kv))
        assert s.per_answer.mean.forwards == pytest.approx(fmean(forwards))
        assert s.per_answer.mean.seconds == pytest.approx(fmean(secs))
        # per step is another comparison: against the same reply read in full
        assert s.saving == pytest.approx(fmean(row_metrics(r).saving for r in mine))
    v = summarize(van, vanilla).per_answer
    assert v is not None and v.mean.attended == v.mean.seconds == 1.0
    assert summarize(by_arm["da"]).per_answer is None  # no vanilla given: none claimed


def test_tables_json_and_plot_name_both_comparisons(rows, tmp_path):
    compact = summary_table(rows, compact=True)
    full = summary_table(rows)
    assert {"per step", "per answer vs vanilla"} <= {str(c.header) for c in compact.columns}
    assert {"per step", "per answer vs vanilla", "median", "KV bytes", "forwards",
            "decode s"} <= {str(c.header) for c in full.columns}
    md = markdown_table(rows)
    assert "| per step saved | per answer vs vanilla: attended (mean / median) |" in md
    assert "| 1.00x / 1.00x |" in md  # the vanilla line against itself
    js = {e["arm"]: e for e in summary_json(rows)}
    da = next(s for *_, a, s in summaries(rows) if a == "da")
    assert js["da"]["per_answer"]["mean"]["attended"] == pytest.approx(da.per_answer.mean.attended)
    alone = [r for r in rows if r["arm"] != "vanilla"]  # no vanilla arm ran: "-"
    assert all(s.per_answer is None for *_, s in summaries(alone))
    assert "| - | - | - | - |" in markdown_table(alone)
    png = savings_plot(rows, tmp_path / "savings.png")
    assert png.stat().st_size > 0
