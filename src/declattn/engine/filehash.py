"""A model file's sha256, read once per version of the file.

Hashing a model means reading all of it (seconds for a large GGUF); a stamp kept under
the file's path, size, inode and modification time lets a later process pay a ``stat``
instead. Both the disk tier's namespace (``kvdisk/identity.py``) and the loader's
converted-GGUF cache (``loader.cache_key``) name things by what a file holds, not where
it lies: the same bytes under another path are the same model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from declattn.engine.kvdisk.atomic import write_atomic

_READ = 4 * 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def sha256_files(files: Sequence[Path], directory: Path | None = None) -> str:
    """sha256 of the files' bytes in order (each preceded by its name within
    ``directory``, when one is given)."""
    h = hashlib.sha256()
    for f in files:
        if directory is not None:
            h.update(f"{f.relative_to(directory).as_posix()}\0".encode())
        with f.open("rb") as handle:
            while block := handle.read(_READ):
                h.update(block)
    return h.hexdigest()


def model_files(path: Path) -> list[Path]:
    """The files whose bytes are the model: the file itself, or a directory's config and
    weight files."""
    if path.is_file():
        return [path]
    return sorted(
        f for f in path.iterdir()
        if f.is_file() and (f.name == "config.json" or f.suffix in _WEIGHT_SUFFIXES)
    )


def file_digest(path: Path, stamps: Path) -> str:
    """sha256 of a model file (or a model directory's files), hashed once per version of
    them: the result is kept in ``stamps`` under each file's path, size, inode and
    modification time, so a later process pays a ``stat`` instead of reading the model.
    A stamp that cannot be written only costs the next process the hash again."""
    path = path.resolve()
    files = model_files(path)
    ident = [[str(f), *_stat(f)] for f in files]
    name = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]
    stamp = stamps / f"{name}.json"
    try:
        recorded = json.loads(stamp.read_text())
        if recorded.get("files") == ident:
            return str(recorded["sha256"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    digest = sha256_files(files, path if path.is_dir() else None)
    try:
        stamps.mkdir(parents=True, exist_ok=True)
        write_atomic(stamp, json.dumps({"files": ident, "sha256": digest}).encode())
    except OSError:
        pass
    return digest


def _stat(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns]
