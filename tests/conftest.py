"""Shared fixtures: the real SmolLM2 tokenizer and tiny random models, loaded once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer():
    from declattn.engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")
