"""``declattn train``, ``train eval`` and ``demo`` on a model trained for a few steps.

A few steps teach nothing, which is the point of the gate test: an untrained lookup must
fail the command loudly instead of writing a model that looks finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from declattn.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    assert main(["train", "da-tiny", "--out", str(out), "--steps", "3", "--batch", "2",
                 "--unmasked", "0.5", "--no-gate"]) == 0
    return out


def test_training_writes_a_loadable_model_directory(trained: Path) -> None:
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "declattn.json", "training.json"} <= names
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["DeclattnTinyForCausalLM"]
    record = json.loads((trained / "training.json").read_text())
    assert [r["step"] for r in record["log"]] == [0, 2]
    assert record["spec"]["unmasked"] == 0.5 and record["threads"] >= 1


def test_a_share_outside_zero_to_one_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "da-tiny", "--out", str(tmp_path), "--unmasked", "1.5"]) == 2
    assert "--unmasked must be between 0 and 1" in capsys.readouterr().err


def test_the_gate_fails_loudly_when_the_lookup_did_not_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "da-tiny", "--out", str(tmp_path), "--steps", "2", "--batch", "2"])
    assert code == 2
    captured = capsys.readouterr()
    assert "the lookup did not form" in captured.err
    assert "value lookup" in captured.out and "chunk id" in captured.out  # what it learned


def test_eval_prints_every_cell(trained: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cells.json"
    assert main(["train", "eval", "--model", str(trained), "--samples", "2",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["arm"] for r in rows} == {"da", "da-nm", "wrong"}
    assert {r["n_chunks"] for r in rows} == {16, 32, 64}
    assert all(r["samples"] == 2 for r in rows)
    text = capsys.readouterr().out
    assert "held-out, 2 samples per row" in text and "teacher forced" in text


def test_demo_uses_a_generated_document_for_a_model_trained_here(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--model", str(trained), "--out", str(tmp_path),
                 "--max-tokens", "24"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "generated paragraphs" in text and "per step (vs the same reply read in full)" in text
    assert "question 1: per answer, DA read" in text  # beside the plain answer
    assert (tmp_path / "record.json").is_file() and (tmp_path / "record.vanilla.json").is_file()
