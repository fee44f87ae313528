"""``declattn train study``: a base model's and a trained model's eval runs as one
study, every per-answer figure against the base model's vanilla answer to the same
sample, not the trained model's own."""

from __future__ import annotations

from statistics import fmean

import pytest

from declattn.cli import main
from declattn.eval.arms import ArmSettings, parse_arms
from declattn.eval.metrics import summarize, vanilla_rows
from declattn.eval.runner import EvalSpec, run_eval
from declattn.eval.study import study_markdown, study_rows


def _run(engine, model: str, arms: str, max_tokens: int, out) -> list[dict]:
    settings = ArmSettings(max_tokens=max_tokens, chunk_target=256, chunk_cap=320)
    spec = EvalSpec(model, ["niah_single_noise"], [1024], parse_arms(arms), 2,
                    settings=settings)
    return run_eval(engine, spec, out, machine={})


@pytest.fixture(scope="module")
def runs(tiny_engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    # Replies of other lengths, so the two models' vanilla answers cost differently.
    base = _run(tiny_engine, "base", "da-economy,vanilla", 6, out / "base.jsonl")
    trained = _run(tiny_engine, "trained", "da,vanilla", 3, out / "trained.jsonl")
    return base, trained, out


def test_only_the_base_models_plain_answers_are_the_vanilla_reference(runs):
    base, trained, _ = runs
    rows = study_rows(base, trained)
    assert {r["model"] for r in rows} == {"study"}
    arms = {r["arm"] for r in rows}
    assert arms == {"vanilla", "da-economy (base)", "da (trained)", "plain-trained"}
    reference = vanilla_rows(rows)
    assert len(reference) == 2
    totals = [r["totals"] for r in reference.values()]
    assert totals == [r["totals"] for r in base if r["arm"] == "vanilla"]
    assert totals != [r["totals"] for r in trained if r["arm"] == "vanilla"]


def test_per_answer_divides_by_the_base_models_vanilla_answer(runs):
    base, trained, _ = runs
    rows = study_rows(base, trained)
    da = [r for r in rows if r["arm"] == "da (trained)"]
    s = summarize(da, vanilla_rows(rows))
    base_van = [r for r in base if r["arm"] == "vanilla"]
    own_van = [r for r in trained if r["arm"] == "vanilla"]
    want = fmean(a["totals"]["logical"] / b["totals"]["logical"]
                 for a, b in zip(da, base_van, strict=True))
    own = fmean(a["totals"]["logical"] / b["totals"]["logical"]
                for a, b in zip(da, own_van, strict=True))
    assert s.per_answer is not None and s.per_answer.n == 2
    assert s.per_answer.mean.attended == pytest.approx(want)
    assert want != pytest.approx(own)  # the test tells the two references apart


def test_the_command_prints_a_family_table_per_length_and_the_summary(runs, capsys):
    base, trained, out = runs
    assert main(["train", "study", str(out / "base.jsonl"), str(out / "trained.jsonl")]) == 0
    text = capsys.readouterr().out
    assert text == study_markdown(base, trained) + "\n"
    assert "### 1,024 tokens" in text and "niah acc / focus on evidence / n" in text
    for arm in ("vanilla", "da-economy (base)", "da (trained)", "plain-trained"):
        assert f"| {arm} |" in text
    assert main(["train", "study", str(out / "none.jsonl"), str(out / "base.jsonl")]) == 2
