"""``declattn eval`` end to end on a tiny random model with the SmolLM2 tokenizer, and
resuming after an interruption; ``declattn roofline`` on the results."""

from __future__ import annotations

import json

import pytest
import torch

from declattn.cli import main
from declattn.eval.arms import MODEL_ARMS, ORDER

ARGS = [
    "--tasks",
    "twohop",
    "--lengths",
    "1024",
    "--arms",
    "all",
    "--max-tokens",
    "6",
    "--chunk-target",
    "256",
    "--chunk-cap",
    "320",
    "--dtype",
    "fp32",
]
ALL = [a for a in ORDER if a not in MODEL_ARMS]
"""What ``--arms all`` runs, in run order: every arm but those of a model trained to
declare (``da-model``, ``da-model-wrong``: they need the model's own DA settings)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def _lines(path):
    return path.read_text().splitlines()


def test_eval_runs_writes_everything_and_resumes(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    cmd = ["eval", "--model", str(model_dir), "--out", str(out), *ARGS]
    assert main([*cmd, "--samples", "1"]) == 0
    results = out / "results.jsonl"
    lines = _lines(results)
    rows = [json.loads(x) for x in lines]
    assert [r["arm"] for r in rows] == ALL  # every arm of "all", in run order
    for r in rows:
        assert "error" not in r
        assert r["header"]["answers"] and r["evidence_chunks"]
        assert len(r["steps"]) == r["totals"]["steps"]
        if r["arm"] in ("streaming", "quest"):
            assert r["budget_blocks"] >= 3
    for name in ("summary.json", "summary.md", "pareto.png", "savings.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "summary.md").read_text()
    assert "--tasks twohop" in md and "| quest |" in md
    assert "declattn eval" in capsys.readouterr().out

    # Interrupted: four rows written (da first: the sparse arms need its budget), the
    # fifth cut mid-line.
    results.write_text("\n".join(lines[:4]) + "\n" + lines[4][:50])
    assert main([*cmd, "--samples", "1"]) == 0
    again = _lines(results)
    assert again[:4] == lines[:4]  # kept, not recomputed
    assert len(again) == len(ALL)
    assert [json.loads(x)["key"] for x in again] == [r["key"] for r in rows]
    assert "resumed: 4 rows" in capsys.readouterr().out

    # More samples: only the new ones run.
    assert main([*cmd, "--samples", "2"]) == 0
    grown = _lines(results)
    assert grown[: len(ALL)] == again and len(grown) == 2 * len(ALL)
    summary = json.loads((out / "summary.json").read_text())
    assert {s["arm"] for s in summary} == {r["arm"] for r in rows}
    assert all(s["n"] == 2 for s in summary)

    # Nothing left to run: the report is rebuilt without loading the model.
    from declattn.api import Engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "from_pretrained", refuse)
    (out / "summary.md").unlink()
    assert main([*cmd, "--samples", "2"]) == 0
    assert _lines(results) == grown and (out / "summary.md").exists()
    monkeypatch.undo()

    assert (
        main(
            [
                "roofline",
                "--results",
                str(results),
                "--config",
                str(model_dir / "config.json"),
                "--dtype",
                "float32",
                "--accelerators",
                "h100",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "measured vs projected" in text and "quest" in text


def test_eval_refuses_bad_requests(model_dir, tmp_path, capsys):
    base = ["eval", "--model", str(model_dir), "--out", str(tmp_path / "x")]
    assert main([*base, "--arms", "streaming"]) == 2
    assert "add da" in capsys.readouterr().err
    assert main([*base, "--tasks", "needles"]) == 2
    assert main([*base, "--lengths", "4Q"]) == 2
