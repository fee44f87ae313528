"""The run loop's bookkeeping: a response that cannot fit the model becomes an error row
(and the sparse arms, which need its budget, say so), and the loop carries on."""

from __future__ import annotations

import json

from declattn.eval.arms import ArmSettings, parse_arms
from declattn.eval.metrics import summarize
from declattn.eval.runner import EvalSpec, read_rows, run_eval


def test_a_prompt_that_does_not_fit_is_an_error_row(tiny_engine, tmp_path):
    spec = EvalSpec(
        "tiny",
        ["niah_single_noise"],
        [1024],
        parse_arms("da,vanilla,streaming"),
        1,
        settings=ArmSettings(max_tokens=7500, chunk_target=256, chunk_cap=320),
    )
    out = tmp_path / "results.jsonl"
    rows = run_eval(tiny_engine, spec, out, machine={})
    assert [r["arm"] for r in rows] == ["da", "vanilla", "streaming"]
    assert "exceeds the model's 8192 positions" in rows[0]["error"]
    assert "no budget: the da arm failed" in rows[2]["error"]
    assert read_rows(out) == [json.loads(json.dumps(r)) for r in rows]
    s = summarize(rows)
    assert s.n == 0 and s.errors == 3 and s.accuracy is None
