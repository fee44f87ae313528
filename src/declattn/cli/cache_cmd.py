"""``declattn cache``: what the prefix cache keeps on disk, and removing it.

The disk tier (``engine/kvdisk``) keeps the K/V of whole prefill chunks so a document is
prefilled once for every process; a document here is the chains of chunks under one
first chunk (a document asked with several questions shares them). ``ls`` lists them
by model, ``du`` sums their bytes, ``rm`` removes documents by id (a prefix of it is
enough), ``clear`` removes everything, or one model's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.table import Table

from declattn.cli.common import UserError, console


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="the prefix cache on disk: ls, du, rm, clear")
    actions = p.add_subparsers(dest="cache_command", required=True)
    ls = actions.add_parser("ls", help="cached documents by model: tokens, size, last use")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_ls)
    du = actions.add_parser("du", help="bytes on disk, by model")
    du.set_defaults(func=run_du)
    rm = actions.add_parser("rm", help="remove cached documents by id (as ls shows it)")
    rm.add_argument("ids", nargs="+", help="document ids, or unique prefixes of them")
    rm.set_defaults(func=run_rm)
    clear = actions.add_parser("clear", help="remove every cached document (or one model's)")
    clear.add_argument("--model", default=None, help="only this model's (the name ls shows)")
    clear.set_defaults(func=run_clear)
    for action in (ls, du, rm, clear):
        action.add_argument("--kv-cache-dir", default=None,
                            help="the cache directory (default $DECLATTN_KV_CACHE_DIR, else "
                            "~/.cache/declattn/kv)")


def _root(args: argparse.Namespace) -> Path:
    from declattn.engine.paths import kv_cache_root

    return Path(args.kv_cache_dir).expanduser() if args.kv_cache_dir else kv_cache_root()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def run_ls(args: argparse.Namespace) -> int:
    from declattn.engine.kvdisk.store import documents

    root = _root(args)
    docs = documents(root)
    if args.json:
        print(json.dumps([d.__dict__ for d in docs], indent=1, ensure_ascii=False))
        return 0
    by_model: dict[str, list[Any]] = defaultdict(list)
    for d in docs:
        by_model[d.model].append(d)
    table = Table(title=f"prefix cache on disk: {root}")
    table.add_column("model")
    table.add_column("document", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("last used", no_wrap=True)
    table.add_column("starts with", ratio=1)
    for model, rows in sorted(by_model.items()):
        for d in rows:
            table.add_row(model, d.id[:12], f"{d.tokens:,}", _size(d.size), _when(d.last_used),
                          d.preview, end_section=d is rows[-1])
    table.caption = f"{len(docs)} documents, {_size(sum(d.size for d in docs))}"
    console().print(table)
    return 0


def run_du(args: argparse.Namespace) -> int:
    from declattn.engine.kvdisk.store import documents, namespaces, scan

    root = _root(args)
    s = scan(root)
    names = {k: str(v.get("model_name", "?")) for k, v in namespaces(root).items()}
    per_model: dict[str, int] = defaultdict(int)
    for c in s.chunks:
        per_model[names.get(c.meta.namespace, "?")] += c.size
    docs = defaultdict(int)
    for d in documents(root):
        docs[d.model] += 1
    table = Table(title=f"prefix cache on disk: {root}")
    for col in ("model", "documents", "bytes"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for model, size in sorted(per_model.items()):
        table.add_row(model, f"{docs[model]:,}", _size(size))
    table.add_section()
    table.add_row("other (records, model digests, writes in progress)", "", _size(s.other_bytes))
    table.add_row("total", f"{sum(docs.values()):,}", _size(s.bytes))
    console().print(table)
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from declattn.engine.kvdisk.store import documents, remove_documents

    root = _root(args)
    known = documents(root)
    for i in args.ids:
        matches = {d.id for d in known if d.id.startswith(i.lower())}
        if not matches:
            raise UserError(f"no cached document {i!r} under {root} (see declattn cache ls)")
        if len(matches) > 1:
            raise UserError(f"{i!r} names {len(matches)} documents: give more of its id")
    removed = remove_documents(root, args.ids)
    console().print(f"removed {len(removed)} document(s), {_size(sum(d.size for d in removed))}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from declattn.engine.kvdisk.store import clear, namespaces

    root = _root(args)
    if args.model is not None:
        models = {str(v.get("model_name")) for v in namespaces(root).values()}
        if args.model not in models:
            raise UserError(f"nothing cached for model {args.model!r} under {root} "
                            f"(cached: {', '.join(sorted(models)) or 'nothing'})")
    freed = clear(root, args.model)
    console().print(f"cleared {_size(freed)} under {root}")
    return 0
