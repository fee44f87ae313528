"""A tokenizer saved into a conversion reads back as it was built, special flags included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from declattn.engine.hf_tokenizer import directory_tokenizer, keep_special_flags


@pytest.mark.parametrize("bos", [True, False])
def test_add_bos_token_survives_a_save(smol_tokenizer: Any, tmp_path: Path, bos: bool) -> None:
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_bos_token = bos  # Gemma's GGUF asks for a BOS; SmolLM2's does not
    tok.save_pretrained(str(tmp_path))
    keep_special_flags(tok, tmp_path / "tokenizer_config.json")
    back = directory_tokenizer(tmp_path)
    assert back.add_bos_token is bos and back.add_eos_token is bool(tok.add_eos_token)
    assert back("hi there").input_ids == tok("hi there").input_ids
