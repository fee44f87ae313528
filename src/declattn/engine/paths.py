"""Where declattn keeps files of its own on the user's machine: one cache root.

``$XDG_CACHE_HOME`` (or ``~/.cache``) then ``declattn/``: converted GGUFs, assembled
shipped models, compiled kernels, the prefix cache's disk tier (``kv/``). Never the
repository, never a model hub's cache.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/declattn`` (``~/.cache/declattn`` without the variable)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "declattn"


KV_CACHE_DIR_ENV = "DECLATTN_KV_CACHE_DIR"
"""Where the disk tier of the prefix cache lives when no directory is given (tests point
it at a temporary directory, so they never write to the user's cache)."""


def kv_cache_root() -> Path:
    """``$DECLATTN_KV_CACHE_DIR``, else ``cache_root()/kv``: the disk tier's files."""
    override = os.environ.get(KV_CACHE_DIR_ENV)
    return Path(override).expanduser() if override else cache_root() / "kv"
