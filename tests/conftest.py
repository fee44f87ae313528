"""Shared fixtures: the real SmolLM2 tokenizer and tiny random models, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

REAL_MODEL_DIRS = {"server", "vllm"}
REAL_MODEL_MODULES = {
    "bench/test_bench_decode.py",
    "cli/test_run_cmd.py",
    "cli/test_train_cmd.py",
    "engine/test_loader.py",
    "engine/test_models.py",
    "engine/test_quant_parity.py",
    "engine/test_registry.py",
    "eval/test_eval_cli.py",
    "show/test_show_browser.py",
    "test_constrain.py",
    "train/test_da_tiny.py",
    "train/test_trainer.py",
}
REAL_MODEL_FIXTURES = {"gemma_base"}
"""Tests that load real model weights (shipped GGUFs, da-tiny), a tokenizer built from a
GGUF, or a browser: what ``make test-fast`` leaves out (``-m "not model"``). ``make
test`` runs everything."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        rel = Path(item.path).relative_to(here)
        real = rel.parts[0] in REAL_MODEL_DIRS or rel.as_posix() in REAL_MODEL_MODULES
        if real or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def smol_tokenizer():
    from declattn.engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")
