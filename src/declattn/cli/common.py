"""What the sub-commands share: reading inputs, turning library errors into user errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from declattn.da.options import DAOptions

if TYPE_CHECKING:
    from declattn.engine.threads import ThreadChoice


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def add_threads_arg(parser: Any) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: one per core measured idle at the start)")


def use_threads_arg(args: Any) -> ThreadChoice:
    """Apply ``--threads``: that many torch threads, or one per idle core unless told,
    since a shared CPU thrashes with more threads than idle cores."""
    from declattn.engine.threads import use_threads

    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    return use_threads(args.threads)


def add_arm_args(parser: Any) -> Any:
    """``--vanilla`` and ``--no-mask``, exclusive; returns their group, for a command
    with another way to run (``run --compare``)."""
    arm = parser.add_mutually_exclusive_group()
    arm.add_argument("--vanilla", action="store_true", help="ordinary prompt, full attention")
    arm.add_argument("--no-mask", action="store_true", help="DA prompt without masking (DA-nm)")
    return arm


def arm_of(args: Any) -> str:
    """The arm ``--vanilla`` / ``--no-mask`` ask for: ``vanilla``, ``da-nm``, else ``da``."""
    return "vanilla" if args.vanilla else "da-nm" if args.no_mask else "da"


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
    from declattn.engine.memory import MemoryShortage
    from declattn.engine.models import ConfigError
    from declattn.protocol.segment import SegmentError
    from declattn.protocol.template import NoChatTemplateError

    try:
        yield
    except (LoadError, ConfigError, MemoryShortage, SegmentError, NoChatTemplateError) as e:
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


def add_dtype_arg(parser: Any, extra: tuple[str, ...] = ()) -> None:
    """``--dtype``: ``auto`` keeps a GGUF's own quantization on a CPU; a dtype loads dense."""
    parser.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32", *extra],
        default="auto",
        help="weights: auto (default) packs a GGUF's matrices from its own 4-bit/8-bit "
        "blocks, bf16 activations; a dtype loads every weight dense in it",
    )


def add_kv_cache_args(parser: Any) -> None:
    """``--kv-cache-dir``, ``--kv-cache-size``, ``--no-kv-disk``: the prefix cache's disk
    tier (documents prefilled once, for every later process too)."""
    g = parser.add_argument_group("prefix cache on disk (declattn cache ls|du|rm|clear)")
    g.add_argument("--kv-cache-dir", default=None,
                   help="where prefilled KV is kept on disk (default $DECLATTN_KV_CACHE_DIR, "
                   "else ~/.cache/declattn/kv)")
    g.add_argument("--kv-cache-size", type=_size, default=None,
                   help="its size limit, e.g. 20G or 512M; the least recently used KV goes "
                   "first (default 20G, or half the disk's free space if less)")
    g.add_argument("--no-kv-disk", action="store_true",
                   help="keep the prefix cache in memory only")


def kv_cache_kwargs(args: Any) -> dict[str, Any]:
    """The ``Engine`` keywords of ``add_kv_cache_args``'s flags."""
    return {"kv_disk": not args.no_kv_disk, "kv_cache_dir": args.kv_cache_dir,
            "kv_cache_size": args.kv_cache_size}


def _size(text: str) -> int:
    from declattn.engine.kvdisk.options import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_focus_args(parser: Any) -> None:
    """``--focus``, ``--index``, ``--economy``, ``--min-context``: how a DA request is
    taught to focus, and when it runs at all."""
    parser.add_argument(
        "--focus", choices=["ids", "find", "both"], default=None,
        help='what the instruction teaches: ids (magic_chunks="K", a global survey first), '
        'find (<focus find="WORDS">: the engine looks the words up) or both; default: '
        "the model's own",
    )
    parser.add_argument(
        "--index", type=int, default=0, metavar="TOKENS",
        help="with --focus find/both: an in-context index of the chunks in the instruction, "
        "within this many tokens (0: none)",
    )
    parser.add_argument(
        "--economy", action="store_true",
        help="the economical protocol (DAOptions.economy): a find focus with the answer "
        "written inside it, scaffold steps read as local, forced tag text in one forward, "
        "a reply that opens with a tag",
    )
    parser.add_argument(
        "--min-context", type=int, default=None, metavar="TOKENS",
        help="a shorter context runs vanilla, and says so (default: the gate decides from "
        "the expected bytes of the whole reply, docs/protocol.md; 0: always DA)",
    )


def focus_options(options: DAOptions, args: Any) -> DAOptions:
    """``options`` (``DAOptions``) with ``--focus``/``--index``/``--min-context`` applied,
    or, with ``--economy``, the economical protocol over the same chunking and settings."""
    import dataclasses

    if args.index < 0:
        raise UserError("--index must be >= 0")
    if args.min_context is not None and args.min_context < 0:
        raise UserError("--min-context must be >= 0")
    floor = options.min_context if args.min_context is None else args.min_context
    if args.economy:
        if args.focus not in (None, "find") or args.index:
            raise UserError("--economy teaches a find focus with its own instruction: "
                            "drop --focus and --index")
        return DAOptions.economy(
            target=options.target, cap=options.cap, sink=options.sink,
            line_start=options.line_start, masking=options.masking, style=options.style,
            runaway=options.runaway, min_context=floor,
        )
    focus = args.focus or options.focus
    return dataclasses.replace(options, focus=focus, index=args.index, min_context=floor)

