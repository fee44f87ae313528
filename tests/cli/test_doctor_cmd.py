"""``declattn doctor``'s engine part, which needs no vLLM: the native build and why, each
op's CPU code, the model's decode route."""

from __future__ import annotations

import json

import pytest

from declattn.cli import main
from declattn.engine import native


def test_doctor_names_the_native_build_its_ops_and_the_decode_route(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lib = native.library()
    assert lib is not None
    assert main(["doctor", "--model", "smollm2-135m", "--engine-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    engine = report["engine"]
    assert engine["native"]["variant"] == lib.variant and engine["native"]["why"] == lib.why
    assert engine["native"]["path"] == str(lib.path)
    assert set(engine["ops"]) >= {"decode_attention", "gguf_linear", "DecodeStack"}
    assert engine["decode_route"] == {
        "kind": "stack",
        "why": f"30 layers of GGUF blocks, one native call per decode step "
        f"(native build {lib.variant})",
    }
    assert report["vllm"].startswith("skipped")

    assert main(["doctor", "--model", "smollm2-135m", "--engine-only"]) == 0
    text = capsys.readouterr().out
    assert f"native extension: {lib.variant} ({lib.origin}: " in text
    assert "decode route: stack: 30 layers" in text and "gguf_linear: " in text


def test_a_model_the_engine_cannot_load_is_said_and_the_rest_still_runs(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model only vLLM would load (here: none at all) does not stop the doctor."""
    missing = str(tmp_path / "no-such-model")
    assert main(["doctor", "--model", missing, "--engine-only", "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engine"]
    assert engine["decode_route"]["kind"] is None
    assert engine["decode_route"]["why"].startswith("not loadable here (")
    assert engine["native"] is not None
