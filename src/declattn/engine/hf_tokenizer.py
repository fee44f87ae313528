"""A Hugging Face directory's tokenizer, as saved and as read back.

The loader saves the tokenizer a GGUF builds into its conversion and every later load
reads it from there, so whatever ``save_pretrained`` drops has to be put back here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def directory_tokenizer(directory: Path) -> Any:
    """A Hugging Face directory's tokenizer.

    ``AutoTokenizer`` reads ``config.json`` to choose a class and warns about a model
    type it does not know (our ``declattn_tiny``), even when ``tokenizer_config.json``
    already names the class; a directory whose tokenizer is a plain
    ``PreTrainedTokenizerFast`` is loaded by that class directly."""
    import transformers

    named = directory / "tokenizer_config.json"
    saved = json.loads(named.read_text()) if named.is_file() else {}
    if saved.get("tokenizer_class") == "PreTrainedTokenizerFast" and (
        directory / "tokenizer.json"
    ).is_file():
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    else:
        tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    for flag in _SPECIAL_FLAGS:  # transformers does not read them back (see below)
        if isinstance(saved.get(flag), bool):
            setattr(tok, flag, saved[flag])
    return tok


_SPECIAL_FLAGS = ("add_bos_token", "add_eos_token")


def keep_special_flags(tokenizer: Any, config: Path) -> None:
    """Write the GGUF tokenizer's ``add_bos_token``/``add_eos_token`` into its saved config.

    A tokenizer built from a GGUF knows them (Gemma's wants a BOS, which the prompt
    renderer adds where a chat template omits it); ``save_pretrained`` leaves them out,
    and ``from_pretrained`` would not apply them, so ``directory_tokenizer`` does."""
    saved = json.loads(config.read_text()) if config.is_file() else {}
    saved.update({f: bool(getattr(tokenizer, f)) for f in _SPECIAL_FLAGS if hasattr(tokenizer, f)})
    config.write_text(json.dumps(saved, indent=2) + "\n")
