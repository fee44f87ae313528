"""``declattn run --compare``, ``replay --plain`` and ``show --plain``: the two
comparisons, named apart, from one definition (``PerAnswer``), on a tiny random model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from declattn.api.results import PerAnswer
from declattn.cli import main
from declattn.show.record import stats_of

QUESTION = "What was counted in the warehouse?"


@pytest.fixture(scope="module")
def compared(tiny_model_dir, long_doc, tmp_path_factory) -> tuple[Path, str]:
    """``run --compare --save``'s two records (DA and plain) and what it printed."""
    folder = tmp_path_factory.mktemp("compare")
    save = folder / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", str(long_doc), "--question",
            QUESTION, "--compare", "--max-tokens", "6", "--dtype", "fp32", "--min-context",
            "0", "--threads", "1", "--save", str(save)]
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(args) == 0
    return folder, buf.getvalue()


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_compare_prints_both_comparisons_named_and_one_verdict(compared):
    folder, out = compared
    da, plain = _load(folder / "run.da.json"), _load(folder / "run.vanilla.json")
    assert (da["arm"], plain["arm"]) == ("da", "vanilla")
    expected = PerAnswer.of(stats_of(da), stats_of(plain))
    assert "per answer: DA reply vs plain reply" in out
    assert "per step (vs the same reply read in full)" in out
    assert expected.verdict() in " ".join(out.split())  # rich wraps the line
    assert "torch threads: 1 of" in out and "as asked" in out
    # the plain answer is asked over the DA prompt's chunks: it reused the document's KV
    assert plain["stats"]["cached_tokens"] > 0
    assert stats_of(plain).logical_attended == stats_of(plain).vanilla_attended


def test_compare_json_carries_the_per_answer_ratios(tiny_model_dir, long_doc, capsys):
    args = ["run", "--model", str(tiny_model_dir), "--context", str(long_doc), "--question",
            QUESTION, "--compare", "--max-tokens", "5", "--dtype", "fp32", "--min-context",
            "0", "--json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    da, van = got["da"]["stats"], got["vanilla"]["stats"]
    pa = got["per_answer"]
    assert pa["attended"] == pytest.approx(da["logical_attended"] / van["logical_attended"])
    assert pa["kv_bytes"] == pytest.approx(da["bytes_read"] / van["bytes_read"])
    assert pa["forwards"] == pytest.approx(da["decode_steps"] / van["decode_steps"])
    assert pa["verdict"].startswith("per answer, DA read")


def test_records_keep_the_da_options_a_replay_needs(compared):
    folder, _ = compared
    da = _load(folder / "run.da.json")
    opts = da["options"]
    # a model without its own settings runs the economical protocol (scaffold rule on)
    assert opts["line_start"] is False and opts["scaffold_local"] is True
    assert opts["target"] == 2048 and "instruction" not in opts
    assert "options" not in _load(folder / "run.vanilla.json")  # a plain request has none


def test_replay_with_plain_gives_the_per_answer_figures(compared, capsys):
    folder, _ = compared
    da, plain = folder / "run.da.json", folder / "run.vanilla.json"
    assert main(["replay", str(da), "--plain", str(plain), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = PerAnswer.of(stats_of(_load(da)), stats_of(_load(plain)))
    assert got["per_answer"] == {**dataclasses.asdict(expected), "verdict": expected.verdict()}
    assert got["totals"] == _load(da)["totals"]  # replay == live
    assert main(["replay", str(da), "--plain", str(plain)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "saved per step: against the same reply read in full" in text
    assert "per answer: DA reply vs plain reply" in text and expected.verdict() in text


def test_replay_plain_must_be_a_plain_record_with_counts(compared, tmp_path, capsys):
    folder, _ = compared
    da = folder / "run.da.json"
    assert main(["replay", str(da), "--plain", str(da)]) == 2
    assert "not a plain answer's record (arm 'da'" in capsys.readouterr().err
    old = _load(folder / "run.vanilla.json")
    del old["stats"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["replay", str(da), "--plain", str(tmp_path / "old.json")]) == 2
    assert "no per-answer counts" in capsys.readouterr().err
    assert main(["replay", str(da), "--line-start"]) == 2  # the record ran without it
    assert "ran with line_start=False" in capsys.readouterr().err


def test_show_with_plain_adds_the_cost_per_answer(compared, tmp_path, capsys):
    folder, _ = compared
    da, plain = folder / "run.da.json", folder / "run.vanilla.json"
    assert main(["show", str(da), "--plain", str(plain), "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = PerAnswer.of(stats_of(_load(da)), stats_of(_load(plain)))
    assert lines[-1] == expected.verdict()
    page = (tmp_path / "run.da.html").read_text()
    assert "per answer (vs the plain reply)" in page
    assert f"{expected.attended:.2f}x attended tokens" in page
    assert "saved per step (vs the same reply read in full)" in page
    assert main(["show", str(da), "--out", str(tmp_path)]) == 0  # without: no such line
    assert capsys.readouterr().out.splitlines()[-1].startswith("focus:")


def test_economy_runs_the_economical_protocol_and_replays_under_its_rule(
    tiny_model_dir, long_doc, tmp_path, capsys
):
    save = tmp_path / "eco.json"
    base = ["run", "--model", str(tiny_model_dir), "--context", str(long_doc), "--question",
            QUESTION, "--max-tokens", "6", "--dtype", "fp32", "--min-context", "0"]
    assert main([*base, "--economy", "--save", str(save)]) == 0
    opts = _load(save)["options"]
    assert (opts["focus"], opts["scaffold_local"], opts["jump_forward"]) == ("find", True, True)
    assert opts["constrain"] is True and opts["target"] == 2048
    capsys.readouterr()
    assert main(["replay", str(save), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"] == _load(save)["totals"]
    assert main([*base, "--economy", "--focus", "ids"]) == 2
    assert "--economy teaches a find focus" in capsys.readouterr().err


def test_the_cli_imports_no_torch_until_a_command_runs():
    code = "import sys, declattn.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
