"""``declattn export``: the merged GGUF it writes loads in our engine and answers as the
registry's ``qwen2.5-0.5b-da`` does, greedy, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from declattn.api import Engine
from declattn.cli import main
from declattn.engine.registry import MODELS

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTION = "When does the night ferry to Skerrow leave?"
CONTEXT = (
    "The harbour office opens at nine. Its clerk sells tickets for every boat.\n\n" * 20
    + "The night ferry to Skerrow leaves at 11:40 pm from the north pier.\n\n"
    + "Fares are paid in cash; the last bus meets the ferry on its return.\n\n" * 20
)


def _greedy(engine: Engine) -> str:
    """The DA reply, greedy (the engine's default sampling)."""
    return engine.answer(CONTEXT, QUESTION, max_tokens=24).text


@pytest.mark.skipif(not MODELS["qwen2.5-0.5b-da"].installed(),
                    reason="qwen2.5-0.5b's packages are not installed")
def test_the_export_answers_as_the_registry_model(tmp_path: Path) -> None:
    out = tmp_path / "qwen-da.gguf"
    assert main(["export", "--model", "qwen2.5-0.5b-da", "--gguf", str(out)]) == 0
    exported = Engine.from_pretrained(out)
    shipped = Engine.from_pretrained("qwen2.5-0.5b-da")
    assert exported.da_defaults == shipped.da_defaults
    assert exported.da_defaults.focus == "find" and exported.da_defaults.target == 512
    a, b = _greedy(exported), _greedy(shipped)
    assert a == b and "11:40" in a, (a, b)
    meta = json.loads((exported.loaded.weights_dir / "declattn.json").read_text())
    assert meta["da"]["scaffold_local"] is True
