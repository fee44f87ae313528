"""``declattn demo`` answers every question twice, DA and plain over the same chunk
transcript, and reports them side by side; the plain answer reuses the document's prefill."""

from __future__ import annotations

import json
from pathlib import Path

from declattn.api.results import PerAnswer
from declattn.cli import main
from declattn.show.record import stats_of


def test_demo_puts_each_da_answer_beside_the_plain_one(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--model", str(tiny_model_dir), "--tokens", "3000", "--max-tokens", "4",
            "--dtype", "fp32", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "torch threads: 1 of" in text
    # DA runs whatever the gate would decide for a lone request, and the gate is quoted
    assert "the gate (da/gate.py): a lone DA reply over" in text and "one of 8 requests" in text
    for stem in ("record", "record.q2"):
        da = json.loads((out / f"{stem}.json").read_text())
        plain = json.loads((out / f"{stem}.vanilla.json").read_text())
        assert (da["arm"], plain["arm"]) == ("da", "vanilla")
        assert da["question"] == plain["question"]
        # the plain prompt keeps the DA prompt's chunk turns: their KV came from the cache
        assert plain["stats"]["cached_tokens"] >= 2048
        assert f"{plain['stats']['cached_tokens']:,} of {plain['stats']['prompt_tokens']:,}" in text
        assert PerAnswer.of(stats_of(da), stats_of(plain)).verdict() in text
    assert "DA answer vs plain answer, per question" in text
    assert "prompt shared with the DA prompt" in text
    assert "per step: DA's reply against the same reply read in full" in text
    for name in ("record.png", "record.html"):  # the picture and page of question 1
        assert (out / name).stat().st_size > 0
    assert "per answer (vs the plain reply)" in (out / "record.html").read_text()
