"""What the sub-commands share: reading inputs, turning library errors into user errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def read_context(path: str) -> str:
    """A file's text, or standard input for ``-``."""
    if path == "-":
        text = sys.stdin.read()
        where = "standard input"
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"context file not found: {path}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"context file {path} is not UTF-8 text ({e.reason})") from e
        where = path
    if not text.strip():
        raise UserError(f"the context from {where} is empty")
    return text


def require_question(question: str | None) -> str:
    if question is None or not question.strip():
        raise UserError("a question is required (--question TEXT)")
    return question


@contextmanager
def user_errors() -> Iterator[None]:
    """Library errors a user can cause become ``UserError``s with the library's message."""
    from declattn.engine.loader import LoadError
    from declattn.engine.models import ConfigError
    from declattn.protocol.prompt import NoChatTemplateError
    from declattn.protocol.segment import SegmentError

    try:
        yield
    except (LoadError, ConfigError, SegmentError, NoChatTemplateError) as e:
        raise UserError(str(e)) from e


def add_model_arg(parser: Any, flag: str = "--model", default: str | None = None) -> None:
    from declattn.engine.registry import MODELS

    parser.add_argument(
        flag,
        default=default,
        required=default is None,
        help=f"a shipped model name ({', '.join(MODELS)}), a GGUF file or a "
        "Hugging Face model directory",
    )
