"""The SmolLM2 tokenizer for the vLLM tests, from the model's converted directory.

That is the tokenizer our engine (``load_model``) and vLLM (which serves the converted
directory) both load; it was saved there from the one the GGUF file's metadata builds,
and reading it takes a fraction of the twenty-odd seconds building it again does. Where
the conversion has not run yet, the shared fixture's way (from the GGUF) is used.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    from declattn.engine.loader import cache_key, converted_cache_root, directory_tokenizer
    from declattn.engine.registry import resolve_model
    from declattn.engine.tokenizer import load_tokenizer

    converted = converted_cache_root() / cache_key(resolve_model("smollm2-135m"))
    if (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file():
        return directory_tokenizer(converted)
    return load_tokenizer("smollm2-135m")
