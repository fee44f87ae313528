"""Where declattn keeps files of its own on the user's machine: one cache root.

``$XDG_CACHE_HOME`` (or ``~/.cache``) then ``declattn/``: converted GGUFs, assembled
shipped models. Never the repository, never a model hub's cache.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/declattn`` (``~/.cache/declattn`` without the variable)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "declattn"
