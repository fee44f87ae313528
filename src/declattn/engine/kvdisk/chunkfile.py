"""One prefill chunk's K/V on disk: a safetensors file, checked before a byte is used.

Tensors ``k`` and ``v``, each ``[layers, kv_heads, chunk_tokens, head_dim]`` in the KV
pool's dtype: exactly the bytes the pools held. Metadata (strings): the format version,
the namespace key, the chunk's digest (the chained digest of its last block, hex) and
its parent's (the chunk before it; empty for a first chunk), its index in the chain, its
token count, a sha256 of ``k``'s bytes then ``v``'s, when it was written, and for a
first chunk a few words of its text (for ``declattn cache ls``).

Files are written whole or not at all (``atomic.write_atomic``). A reader checks
the header against what it looks for (namespace, digest, parent, index, shape, dtype)
and the checksum against the bytes: any difference raises ``DamagedChunk``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

FORMAT_VERSION = "1"
"""The file layout's version: bump it when what a file holds or means changes."""
SUFFIX = ".safetensors"


class DamagedChunk(Exception):
    """A chunk file that is not what its name promises (truncated, corrupt, another
    model's, another format's); the message says what differs."""


@dataclass(frozen=True)
class ChunkMeta:
    """A chunk file's header: where the chunk sits and what it belongs to."""

    namespace: str
    digest: str
    parent: str
    index: int
    tokens: int
    created: float = 0.0
    preview: str = ""

    def strings(self, checksum: str) -> dict[str, str]:
        return {
            "format": FORMAT_VERSION, "namespace": self.namespace, "digest": self.digest,
            "parent": self.parent, "index": str(self.index), "tokens": str(self.tokens),
            "created": repr(self.created), "preview": self.preview, "sha256": checksum,
        }

    @classmethod
    def parse(cls, meta: dict[str, str] | None) -> tuple[ChunkMeta, str]:
        """The header of a file and its checksum; ``DamagedChunk`` if it is not one."""
        if not meta or meta.get("format") != FORMAT_VERSION:
            raise DamagedChunk(f"format {(meta or {}).get('format')!r}, not {FORMAT_VERSION!r}")
        try:
            parsed = cls(meta["namespace"], meta["digest"], meta["parent"], int(meta["index"]),
                         int(meta["tokens"]), float(meta["created"]), meta.get("preview", ""))
            return parsed, meta["sha256"]
        except (KeyError, ValueError) as e:
            raise DamagedChunk(f"header field {e} missing or malformed") from e


def checksum(k: Tensor, v: Tensor) -> str:
    """sha256 of ``k``'s bytes then ``v``'s."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode(meta: ChunkMeta, k: Tensor, v: Tensor) -> bytes:
    """The file's bytes (``k``, ``v`` on the CPU)."""
    return save({"k": k, "v": v}, metadata=meta.strings(checksum(k, v)))


def read_header(path: Path) -> ChunkMeta:
    """A chunk file's header alone (for listings and eviction); ``DamagedChunk`` if it
    is not a chunk file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return ChunkMeta.parse(f.metadata())[0]
    except DamagedChunk:
        raise
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise DamagedChunk(f"unreadable header ({e})") from e


def read_chunk(
    path: Path, want: ChunkMeta, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` of the chunk file at ``path``, checked against ``want`` (all but its
    time and preview), ``shape`` and ``dtype`` and against its checksum.

    ``FileNotFoundError`` when there is no such file (a miss); ``DamagedChunk`` for a
    file that is there but not the chunk asked for, or not whole."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, recorded = ChunkMeta.parse(f.metadata())
            if sorted(f.keys()) != ["k", "v"]:
                raise DamagedChunk(f"tensors {sorted(f.keys())}, not k and v")
            k, v = f.get_tensor("k"), f.get_tensor("v")
    except (FileNotFoundError, DamagedChunk):
        raise
    except Exception as e:  # truncated files and bad headers raise safetensors' errors
        raise DamagedChunk(f"unreadable ({e})") from e
    got = (meta.namespace, meta.digest, meta.parent, meta.index, meta.tokens)
    expected = (want.namespace, want.digest, want.parent, want.index, want.tokens)
    if got != expected:
        raise DamagedChunk(f"header says {got}, expected {expected}")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise DamagedChunk(f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    if checksum(k, v) != recorded:
        raise DamagedChunk("checksum mismatch")
    return k, v
