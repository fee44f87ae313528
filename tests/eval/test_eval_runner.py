"""The run loop's bookkeeping: a response that cannot fit the model becomes an error row
(and the sparse arms, which need its budget, say so), and the loop carries on."""

from __future__ import annotations

import json
import re

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
    m = re.search(r"prompt of (\d+) tokens.* a document of (\d+) tokens fits", rows[0]["error"])
    assert m and int(m[2]) == (8192 - 7500) * 1024 // int(m[1])  # the overhead, scaled
    assert "no budget: the da arm failed" in rows[2]["error"]
    assert read_rows(out) == [json.loads(json.dumps(r)) for r in rows]
    s = summarize(rows)
    assert s.n == 0 and s.errors == 3 and s.accuracy is None


class _NoEngine:
    """A finished run must be judged without touching the model."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine was used ({name})")


def test_a_judge_added_to_a_finished_run_judges_it_without_the_model(tiny_engine, tmp_path):
    import httpx

    from declattn.eval.judge import Judge

    spec = EvalSpec(
        "tiny", ["niah_single_noise"], [1024], parse_arms("da,vanilla"), 1,
        settings=ArmSettings(max_tokens=8, chunk_target=256, chunk_cap=320),
    )
    out = tmp_path / "results.jsonl"
    first = run_eval(tiny_engine, spec, out, machine={})
    assert all("judge" not in r for r in first)
    asked = []

    def reply(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.content)["messages"][0]["content"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "NO"}}]})

    judge = Judge("http://judge.local/v1", "grader", transport=httpx.MockTransport(reply))
    again = run_eval(_NoEngine(), spec, out, machine={}, judge=judge)
    answered = [r for r in first if r["output"]["answer"]]
    assert len(asked) == len(answered)
    assert all(first[0]["header"]["question"] in text for text in asked)
    assert [r["judge"]["verdict"] for r in again] == [False, False]
    assert read_rows(out) == [json.loads(json.dumps(r)) for r in again]  # the file too
    run_eval(_NoEngine(), spec, out, machine={}, judge=judge)
    assert len(asked) == len(answered)  # judged once
    from declattn.eval.report import markdown_table

    assert "| judge |" in markdown_table(again) and "| judge |" not in markdown_table(first)
