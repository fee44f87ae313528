"""``declattn train da-lora``: a run that is stopped resumes from its checkpoint to the
very adapter an unbroken run writes, and the output directory is a servable model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from declattn.cli import main
from declattn.train.da_lora import CHECKPOINT, LoRARun, Progress, RunMismatch, train_da_lora

pytestmark = [pytest.mark.model, pytest.mark.slow]

RUN = LoRARun(
    base="smollm2-135m", steps=2, batch=1, heldout=1, heldout_every=1, checkpoint_every=1,
    min_context=300, max_context=500, chunk_target=96, chunk_cap=128,
)


class Stop(Exception):
    pass


def test_a_stopped_run_resumes_to_the_same_adapter(tmp_path: Path) -> None:
    whole = train_da_lora(RUN, tmp_path / "whole")

    def stop(step: int, loss: float, lr: float) -> None:
        if step == 1:
            raise Stop

    broken = tmp_path / "broken"
    with pytest.raises(Stop):
        train_da_lora(RUN, broken, Progress(on_step=stop))
    assert (broken / CHECKPOINT).is_file()
    with pytest.raises(RunMismatch):
        train_da_lora(LoRARun(**{**RUN.__dict__, "lr": 1e-4}), broken)
    resumed = train_da_lora(RUN, broken)
    assert not (broken / CHECKPOINT).exists()
    a = (tmp_path / "whole" / "adapter_model.safetensors").read_bytes()
    assert a == (broken / "adapter_model.safetensors").read_bytes()
    assert [r["loss"] for r in resumed["log"]] == [r["loss"] for r in whole["log"]]
    assert resumed["data"] == whole["data"] and len(whole["heldout"]) == 3
    settings = json.loads((broken / "declattn.json").read_text())["da"]
    assert settings["focus"] == "find" and settings["scaffold_local"] is True
    assert settings["target"] == RUN.chunk_target


def test_only_the_shipped_bases_train(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "da-lora", "--base", "gemma3-270m", "--out", str(tmp_path)]) == 2
    assert "--base must be qwen2.5-0.5b or smollm2-135m" in capsys.readouterr().err
