"""The disk tier's directory: namespaces of chunk files, what they hold, and eviction.

    <root>/<namespace key>/namespace.json        what the namespace is (for listings)
    <root>/<namespace key>/<digest>.safetensors  one prefill chunk (``chunkfile.py``)
    <root>/<namespace key>/.tmp-*                a write in progress, or a dead one's
    <root>/stamps/                               model files' digests (``identity.py``)

A chunk file's modification time is its last use: set when it is written, touched each
time a request's prefix runs through it. Eviction removes the least recently used file
and every file whose chain runs through it (a lookup walks a chain from its first chunk,
so they could no longer be reached), until the directory fits its limit. A document is
the tree of chains under one first chunk; ``declattn cache`` lists and removes those.
Several processes may share a directory: a file another one removed first is simply gone.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from declattn.engine.kvdisk.atomic import TMP_PREFIX, is_dead, write_atomic
from declattn.engine.kvdisk.chunkfile import SUFFIX, ChunkMeta, DamagedChunk, read_header
from declattn.engine.kvdisk.identity import Namespace

STAMPS = "stamps"
NAMESPACE_FILE = "namespace.json"


@dataclass(frozen=True)
class StoredChunk:
    path: Path
    meta: ChunkMeta
    size: int
    used_ns: int


@dataclass(frozen=True)
class Scan:
    """What a directory holds: readable chunks, junk (damaged chunk files, dead
    temporary files), and the bytes of everything else (namespace records, stamps,
    writes in progress)."""

    chunks: list[StoredChunk]
    junk: list[Path]
    other_bytes: int

    @property
    def bytes(self) -> int:
        return sum(c.size for c in self.chunks) + self.other_bytes


@dataclass(frozen=True)
class StoredDocument:
    """The chains under one first chunk, in one namespace."""

    id: str
    namespace: str
    model: str
    tokens: int
    chunks: int
    size: int
    created: float
    last_used: float
    preview: str


def namespace_dir(root: Path, key: str) -> Path:
    return root / key


def chunk_path(root: Path, key: str, digest: str) -> Path:
    return root / key / f"{digest}{SUFFIX}"


def ensure_namespace(root: Path, ns: Namespace) -> None:
    """Create the namespace's directory and its record (``OSError`` if it cannot)."""
    directory = namespace_dir(root, ns.key)
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / NAMESPACE_FILE
    if not record.exists():
        write_atomic(record, json.dumps(ns.to_dict(), indent=1).encode())


def namespaces(root: Path) -> dict[str, dict[str, object]]:
    """Each namespace's record by key (empty where it is unreadable)."""
    out: dict[str, dict[str, object]] = {}
    for d in _namespace_dirs(root):
        try:
            out[d.name] = json.loads((d / NAMESPACE_FILE).read_text())
        except (OSError, ValueError):
            out[d.name] = {}
    return out


def _namespace_dirs(root: Path) -> list[Path]:
    try:
        return sorted(d for d in root.iterdir() if d.is_dir() and d.name != STAMPS)
    except OSError:
        return []


def scan(root: Path) -> Scan:
    """Read every namespace's chunk headers and sizes (one small read per file)."""
    chunks, junk, other = [], [], 0
    now = time.time()
    for f in _files(root):
        try:
            st = f.stat()
        except OSError:
            continue  # removed meanwhile
        if f.name.startswith(TMP_PREFIX):
            if is_dead(f, now - st.st_mtime):
                junk.append(f)
            else:
                other += st.st_size
        elif f.name.endswith(SUFFIX):
            try:
                chunks.append(StoredChunk(f, read_header(f), st.st_size, st.st_mtime_ns))
            except DamagedChunk:
                junk.append(f)
        else:
            other += st.st_size
    return Scan(chunks, junk, other)


def _files(root: Path) -> Iterable[Path]:
    try:
        for d in root.iterdir():
            if d.is_dir():
                yield from (f for f in d.iterdir() if f.is_file())
    except OSError:
        return


def usage(root: Path) -> int:
    """Bytes of every file under ``root`` (``stat`` only)."""
    total = 0
    for f in _files(root):
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def _remove(paths: Iterable[Path]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


Children = dict[tuple[str, str], list[StoredChunk]]
"""Chunks by (namespace, parent digest)."""


def _children(chunks: list[StoredChunk]) -> Children:
    out: Children = defaultdict(list)
    for c in chunks:
        out[(c.meta.namespace, c.meta.parent)].append(c)
    return out


def _subtree(top: StoredChunk, children: Children) -> list[StoredChunk]:
    """``top`` and every chunk whose chain runs through it."""
    out, todo = [], [top]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(children.get((c.meta.namespace, c.meta.digest), ()))
    return out


def _orphans(chunks: list[StoredChunk]) -> list[StoredChunk]:
    """Chunks whose parent file is gone: no lookup can reach them."""
    present = {(c.meta.namespace, c.meta.digest) for c in chunks}
    return [c for c in chunks if c.meta.index and (c.meta.namespace, c.meta.parent) not in present]


def evict(root: Path, limit: int) -> int:
    """Remove junk, unreachable chunks, then least recently used chunks (with every chain
    through them) until at most ``limit`` bytes remain; returns the bytes left."""
    s = scan(root)
    _remove(s.junk)
    gone = {id(c) for c in _orphans(s.chunks)}
    total = s.other_bytes + sum(c.size for c in s.chunks if id(c) not in gone)
    children = _children(s.chunks)
    for oldest in sorted(s.chunks, key=lambda c: c.used_ns):
        if total <= limit:
            break
        if id(oldest) in gone:
            continue
        for c in _subtree(oldest, children):
            if id(c) not in gone:
                gone.add(id(c))
                total -= c.size
    _remove(c.path for c in s.chunks if id(c) in gone)
    return total


def documents(root: Path) -> list[StoredDocument]:
    """Every document (the chains under one first chunk), most recently used first."""
    s = scan(root)
    names = namespaces(root)
    children = _children(s.chunks)
    docs = []
    for top in (c for c in s.chunks if c.meta.index == 0):
        tree = _subtree(top, children)
        deepest = max(c.meta.index for c in tree)
        docs.append(StoredDocument(
            id=top.meta.digest, namespace=top.meta.namespace,
            model=str(names.get(top.meta.namespace, {}).get("model_name", "?")),
            tokens=(deepest + 1) * top.meta.tokens, chunks=len(tree),
            size=sum(c.size for c in tree), created=min(c.meta.created for c in tree),
            last_used=max(c.used_ns for c in tree) / 1e9, preview=top.meta.preview,
        ))
    return sorted(docs, key=lambda d: -d.last_used)


def remove_documents(root: Path, ids: Iterable[str]) -> list[StoredDocument]:
    """Remove the documents whose id starts with one of ``ids`` (every chain under them)."""
    prefixes = tuple(i.lower() for i in ids)
    s = scan(root)
    children = _children(s.chunks)
    chosen = [d for d in documents(root) if d.id.startswith(prefixes)]
    tops = {(d.namespace, d.id) for d in chosen}
    for top in s.chunks:
        if top.meta.index == 0 and (top.meta.namespace, top.meta.digest) in tops:
            _remove(c.path for c in _subtree(top, children))
    return chosen


def clear(root: Path, model: str | None = None) -> int:
    """Remove every namespace (or those of ``model``) with all their files; returns the
    bytes freed. Model digest stamps stay (they are cheap, and cost a hash to remake)."""
    freed = 0
    for key, record in namespaces(root).items():
        if model is not None and record.get("model_name") != model:
            continue
        d = namespace_dir(root, key)
        for f in list(d.iterdir()):
            with contextlib.suppress(OSError):
                freed += f.stat().st_size
                f.unlink()
        with contextlib.suppress(OSError):
            d.rmdir()
    return freed
