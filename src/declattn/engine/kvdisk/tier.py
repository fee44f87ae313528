"""The prefix cache's disk tier: K/V of whole prefill chunks kept in files, so a document
prefilled once is prefilled once for every later process too.

The engine calls it at two points. Before a prefill (``restore``), after the in-memory
cache has given what it holds, it walks the prompt's chain of chunk files from there and
reads each one straight into newly allocated blocks of the pool, which it then addresses
like computed ones (so later prompts in the process find them in memory). After a prefill
step (``save``), a chunk that was computed whole — ``prefill_chunk`` positions starting
at a multiple of it, every position a full prompt block — is copied out of the pool and
queued for a background write.

Why whole chunks only: the engine shares a prefix only at a multiple of the prefill
chunk, so that the rest is prefilled in exactly the chunks a fresh prefill would use and
the results are bit for bit a fresh prefill's (``PagedEngine._share_prefix``). A chunk
file therefore always holds K/V that some fresh prefill computed with these boundaries,
and a prompt's remainder after it is computed with the same boundaries again.

Never a wrong answer: a file that does not check out (``chunkfile.read_chunk``) is
removed and its chunk computed, with one warning per engine; a failed write (a full disk,
no permission) stops this engine's writes, with one warning naming the cause and fix;
reads go on.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from declattn.engine.kv import KVCache, KVConfig, PoolExhausted
from declattn.engine.kvdisk.atomic import write_atomic
from declattn.engine.kvdisk.chunkfile import ChunkMeta, DamagedChunk, encode, read_chunk
from declattn.engine.kvdisk.identity import (
    Namespace,
    engine_digest,
    platform_identity,
    threads_identity,
)
from declattn.engine.kvdisk.options import DiskOptions, default_limit
from declattn.engine.kvdisk.store import chunk_path, ensure_namespace, evict, usage
from declattn.engine.kvdisk.writer import BackgroundWriter
from declattn.engine.request import Request

_PREVIEW_TOKENS = 48
_PREVIEW_CHARS = 80
_FULL = (errno.ENOSPC, errno.EDQUOT)
_FIX = "pass --kv-cache-dir elsewhere, a smaller --kv-cache-size, or --no-kv-disk"


class KVDiskWarning(RuntimeWarning):
    """The disk tier met a damaged file or could not write; the message says what."""


class DiskTier:
    """Reads and writes one engine's chunk files under ``options.directory``."""

    def __init__(
        self, options: DiskOptions, kv: KVConfig, prefill_chunk: int, prefill_budget: int,
        tokenizer: Any,
    ) -> None:
        self.options = options
        self.root: Path = options.directory
        self.kv = kv
        self.chunk = prefill_chunk
        self.budget = prefill_budget
        self.chunk_blocks = prefill_chunk // kv.block_size
        self.shape = (kv.n_layers, kv.n_kv_heads, prefill_chunk, kv.head_dim)
        self._tokenizer = tokenizer
        self._writer = BackgroundWriter(self._write_failed)
        self._writing = True
        self._warned: set[str] = set()
        self._limit: int | None = None  # known once the first write opens the directory
        self._bytes = 0

    @functools.cached_property
    def namespace(self) -> Namespace:
        kv = self.kv
        return Namespace(
            model_name=self.options.model_name, model=self.options.model,
            kv_dtype=str(kv.dtype).removeprefix("torch."), block_size=kv.block_size,
            prefill_chunk=self.chunk, prefill_budget=self.budget, layers=kv.n_layers,
            kv_heads=kv.n_kv_heads,
            head_dim=kv.head_dim, engine=engine_digest(),
            platform=platform_identity(torch.device(kv.device)),
            threads=threads_identity(kv.dtype),
        )

    @property
    def writing(self) -> bool:
        """False once a write failed: this engine then only reads."""
        return self._writing

    def _path(self, digest: bytes) -> Path:
        return chunk_path(self.root, self.namespace.key, digest.hex())

    # -- reads ---------------------------------------------------------------------
    def restore(
        self, cache: KVCache, seq: Request, digests: Sequence[bytes], shared: int, room: int
    ) -> int:
        """Read the chunks of ``seq``'s prompt after its ``shared`` blocks (a multiple of
        a chunk, already in memory) from disk into its table, at most ``room`` blocks;
        ``digests``: the prompt blocks it may share. Returns the blocks read, counts
        their positions in ``seq.disk_tokens`` (on its first admission, not a resume)
        and the time taken in its ``prefill_seconds`` (the wait is the prefill's)."""
        t0 = time.perf_counter()
        read = self._restore(cache, seq, digests, shared, room)
        seq.prefill_seconds += time.perf_counter() - t0
        if not seq.preemptions:
            seq.disk_tokens = read * self.kv.block_size
        return read

    def _restore(
        self, cache: KVCache, seq: Request, digests: Sequence[bytes], shared: int, room: int
    ) -> int:
        cb = self.chunk_blocks
        first = shared // cb
        found = []
        for j in range(first, min(len(digests) // cb, first + max(0, room) // cb)):
            if not self._path(digests[(j + 1) * cb - 1]).exists():
                break
            found.append(j)
        if found:
            try:
                cache.allocate(seq.seq_id, (found[-1] + 1) * self.chunk)
            except PoolExhausted:
                found = []
        done = first
        for j in found:
            kv = self._read(j, digests)
            if kv is None:
                break
            cache.import_rows(seq.seq_id, j * self.chunk, *kv)
            for b in range(j * cb, (j + 1) * cb):
                cache.register(seq.seq_id, b, digests[b])
            done = j + 1
        self._touch(digests, done)
        return (done - first) * cb

    def _read(self, j: int, digests: Sequence[bytes]) -> tuple[Tensor, Tensor] | None:
        cb = self.chunk_blocks
        parent = digests[j * cb - 1].hex() if j else ""
        want = ChunkMeta(self.namespace.key, digests[(j + 1) * cb - 1].hex(), parent, j,
                         self.chunk)
        path = self._path(digests[(j + 1) * cb - 1])
        try:
            return read_chunk(path, want, self.shape, self.kv.dtype)
        except FileNotFoundError:
            return None  # removed since it was seen (eviction by another process)
        except (DamagedChunk, OSError) as e:
            with contextlib.suppress(OSError):
                path.unlink()
            self._warn_once("damaged", (
                f"KV disk cache: {path} was damaged ({e}); it was removed and its KV is "
                "computed again (later damaged files are removed without a warning)"
            ))
            return None

    def _touch(self, digests: Sequence[bytes], n_chunks: int) -> None:
        """Mark the first ``n_chunks`` chunk files used now, the first the newest (so an
        eviction trims a document from its end)."""
        cb = self.chunk_blocks
        now = time.time_ns()
        for j in range(n_chunks):
            stamp = now + n_chunks - j
            with contextlib.suppress(OSError):
                os.utime(self._path(digests[(j + 1) * cb - 1]), ns=(stamp, stamp))

    # -- writes --------------------------------------------------------------------
    def save(self, cache: KVCache, seq: Request, start: int, stop: int) -> None:
        """Queue the write of positions ``[start, stop)`` of ``seq``, just computed, if
        they are one whole chunk of full prompt blocks not on disk yet."""
        bs = self.kv.block_size
        if (not self._writing or stop - start != self.chunk or start % self.chunk
                or stop // bs > len(seq.digests)):
            return
        path = self._path(seq.digests[stop // bs - 1])
        if path.exists():
            return  # written before, by this process or another: names are write-once
        j = start // self.chunk
        meta = ChunkMeta(
            self.namespace.key, seq.digests[stop // bs - 1].hex(),
            seq.digests[start // bs - 1].hex() if j else "", j, self.chunk, time.time(),
            self._preview(seq) if j == 0 else "",
        )
        k, v = cache.export_rows(seq.seq_id, start, stop)
        self._writer.submit(functools.partial(self._write, path, meta, k, v))

    def flush(self) -> None:
        """Wait for the queued writes."""
        self._writer.flush()

    def _write(self, path: Path, meta: ChunkMeta, k: Tensor, v: Tensor) -> None:
        """On the writer's thread."""
        if not self._writing:
            return
        if self._limit is None:
            ensure_namespace(self.root, self.namespace)
            limit = self.options.max_bytes
            self._limit = limit if limit is not None else default_limit(self.root)
            self._bytes = usage(self.root)
        data = encode(meta, k, v)
        write_atomic(path, data)
        self._bytes += len(data)
        if self._bytes > self._limit:
            self._bytes = evict(self.root, self._limit)

    def _write_failed(self, error: BaseException) -> None:
        self._writing = False
        full = isinstance(error, OSError) and error.errno in _FULL
        cause = "the disk is full" if full else f"{type(error).__name__}: {error}"
        self._warn_once("write", (
            f"KV disk cache: cannot write under {self.root} ({cause}); this engine stops "
            f"writing KV to disk (it still reads what is there). Free space, or {_FIX}"
        ))

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, KVDiskWarning, stacklevel=3)

    def _preview(self, seq: Request) -> str:
        """A few words of the prompt for listings: from its first magic chunk where it
        has one (the document), else from its start."""
        ids = seq.prompt_ids
        regions = seq.controller.regions(0, min(len(ids), 4 * self.chunk))
        start = next((p for p, r in enumerate(regions) if r > 0), 0)
        text = self._tokenizer.decode(ids[start : start + _PREVIEW_TOKENS],
                                      skip_special_tokens=True)
        return " ".join(text.split())[:_PREVIEW_CHARS]
