"""Shared fixtures: the real SmolLM2 tokenizer and tiny random models, loaded once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REAL_MODEL_DIRS = {"server", "vllm"}
REAL_MODEL_MODULES = {
    "bench/test_bench_decode.py",
    "cli/test_doctor_cmd.py",
    "bench/test_bench_reuse.py",
    "cli/test_run_cmd.py",
    "cli/test_train_cmd.py",
    "engine/test_loader.py",
    "engine/test_models.py",
    "engine/test_quant_parity.py",
    "engine/test_registry.py",
    "eval/test_eval_cli.py",
    "show/test_show_browser.py",
    "da/test_constrain.py",
    "api/test_jump_forward.py",
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


_KV_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Engines made outside a test (session and module fixtures) keep their disk tier in
    a temporary directory too: never in the user's cache."""
    from declattn.engine.paths import KV_CACHE_DIR_ENV

    config.stash[_KV_DIR] = os.environ[KV_CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="declattn-kv-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if kv_dir := config.stash.get(_KV_DIR, None):
        shutil.rmtree(kv_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _kv_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """The prefix cache's disk tier of every engine a test makes (and of every command a
    test runs) lives in a directory of its own: never the user's cache, and no test finds
    the K/V another one left."""
    from declattn.engine.paths import KV_CACHE_DIR_ENV

    monkeypatch.setenv(KV_CACHE_DIR_ENV, str(tmp_path_factory.mktemp("kv")))


@pytest.fixture(scope="session")
def smol_tokenizer():
    from declattn.engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def random_smol_model(smol_tokenizer):
    """A 2-layer Llama with random weights (seed 0) over SmolLM2's real vocabulary and
    chat template: the whole DA prompt path, with no weights to load. Each test module
    puts its own ``Engine`` (and KV pool) over it."""
    import torch

    from declattn.engine.loader import LoadedModel
    from declattn.engine.models import Decoder, ModelConfig

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": len(smol_tokenizer), "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192, "rope_theta": 10000.0, "tie_word_embeddings": True,
    }
    torch.manual_seed(0)
    config = ModelConfig.from_hf(cfg)
    model = Decoder(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return LoadedModel(model.eval(), config, smol_tokenizer, Path("."))
