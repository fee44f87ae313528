"""Files written whole or not at all, under names that say who is writing them.

A file is written to a temporary name in its final directory, flushed to the disk
(``fsync``) and renamed into place: a reader sees the whole file or none, and a process
killed mid-write leaves only the temporary file, which no reader opens. The temporary
name carries the writer's host and process id, so a sweep can tell a write in progress
from a dead one (``is_dead``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path

TMP_PREFIX = ".tmp-"
STALE_SECONDS = 3600
"""A temporary file older than this is a dead write even where its writer cannot be
asked (another host sharing the directory)."""


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def tmp_name(final: Path) -> Path:
    """``.tmp-<name>.<host>.<pid>.<random>`` beside ``final``."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{_host()}.{os.getpid()}."
                           f"{secrets.token_hex(4)}")


def is_dead(tmp: Path, age_seconds: float) -> bool:
    """Whether the temporary file ``tmp`` belongs to no live write: too old, or written by
    a process of this host that is gone."""
    if age_seconds > STALE_SECONDS:
        return True
    parts = tmp.name.split(".")
    if len(parts) < 4 or parts[-3] != _host():
        return False
    try:
        os.kill(int(parts[-2]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, OSError):  # not a pid, or someone else's process: alive
        return False
    return False


def write_atomic(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` whole or not at all. A file already at ``final`` (another
    process wrote the same name meanwhile) is replaced by this one: one copy remains."""
    tmp = tmp_name(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every platform opens directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
