"""How the layer above asks for the disk tier: where, how large, for which model.

The default size is 20 GiB, or half of what the disk can give the cache (its free space
plus what the cache already holds) where that is less. 20 GiB holds about 50 documents
of 32K tokens for a 0.5B model (12 KiB of K/V a token) or ten for a 7B one (56 KiB a
token): enough to keep the documents a user is working on, small enough not to surprise
anyone on a laptop; the half-the-disk cap keeps it from filling a small disk.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from declattn.engine.kvdisk.identity import model_identity
from declattn.engine.kvdisk.store import STAMPS, usage
from declattn.engine.models import Decoder

DEFAULT_MAX_BYTES = 20 * 1024**3
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class DiskOptions:
    """The disk tier of one engine: ``model`` identifies the weights (see
    ``identity.model_identity``), ``model_name`` is what listings show."""

    model_name: str
    model: str
    directory: Path
    max_bytes: int | None = None
    """``None``: ``default_limit``."""


def parse_size(text: str | int) -> int:
    """Bytes from ``"20G"``, ``"512M"``, ``"1.5GiB"``, ``"300000"`` (units of 1024);
    ``ValueError`` naming the problem otherwise."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(text)
        if m is None:
            raise ValueError(f"not a size: {text!r} (write e.g. 20G, 512M or a byte count)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise ValueError(f"a KV cache size must be positive, got {text!r}")
    return value


def default_limit(root: Path) -> int:
    """``DEFAULT_MAX_BYTES``, or half of the disk's free space plus the cache's own bytes
    where that is less."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DEFAULT_MAX_BYTES
    return min(DEFAULT_MAX_BYTES, (free + usage(root)) // 2)


def disk_options(
    model: Decoder,
    source: Path | None,
    model_name: str,
    directory: Path | None,
    max_bytes: int | None,
    default_directory: Path,
) -> DiskOptions | None:
    """The options for ``model`` loaded from ``source`` (``None``: weights made in memory).

    A model with no files gets a disk tier only where a ``directory`` is asked for: its
    identity is a hash of all its weights (seconds for a large one), and random weights
    in tests and benchmarks have no business in the user's cache."""
    if source is None and directory is None:
        return None
    root = directory if directory is not None else default_directory
    identity = model_identity(model, source, root / STAMPS)
    return DiskOptions(model_name, identity, root, max_bytes)
