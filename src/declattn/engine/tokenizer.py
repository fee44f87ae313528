"""Loading only a tokenizer (with its chat template), for commands that need no weights.

A GGUF's tokenizer is read from the loader's conversion of the file when there is one
(a directory read); building it from GGUF metadata takes tens of seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from declattn.engine.hf_tokenizer import directory_tokenizer
from declattn.engine.loader import CorruptModelError, ModelNotFoundError, conversion_dir
from declattn.engine.registry import resolve_model


def load_tokenizer(path_or_name: str | Path) -> Any:
    """A shipped model's name, a GGUF file, or a directory with tokenizer files."""
    path = resolve_model(path_or_name)
    from transformers import AutoTokenizer

    try:
        if path.is_file():
            converted = conversion_dir(path)
            if (converted / "config.json").is_file() and any(converted.glob("tokenizer*")):
                return directory_tokenizer(converted)
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not any(path.glob("tokenizer*")):
            raise ModelNotFoundError(f"{path}: no tokenizer files (tokenizer.json, ...) here")
        return directory_tokenizer(path)
    except (ModelNotFoundError, CorruptModelError):
        raise
    except Exception as e:  # transformers raises many kinds for a bad file
        raise CorruptModelError(f"{path}: cannot load a tokenizer ({e})") from e
