"""The disk tier's limits: a size cap enforced by evicting the least recently used chunks
first (with every chain through them), and a full disk that turns writing off with one
warning while answers stay right."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch
from disk_world import chunk_files, engine, run
from tiny_world import prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.kvdisk import tier
from declattn.engine.kvdisk.chunkfile import read_header
from declattn.engine.kvdisk.store import documents, evict, usage
from declattn.engine.kvdisk.tier import KVDiskWarning


def test_the_size_limit_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    model = tiny_model(seed=4)
    a, b, c = (prompt(140, 20 + i) for i in range(3))  # two whole chunks each
    run(engine(model, tmp_path), Controller(a))
    limit = 2 * usage(tmp_path) + 1000  # room for two documents, not three
    run(engine(model, tmp_path, max_bytes=limit), Controller(b))
    reader = engine(model, tmp_path, max_bytes=limit)
    assert run(reader, Controller(a + prompt(3, 1)))[0].disk_tokens == 128  # a used again
    run(reader, Controller(c))  # over the limit: b, unused since it was written, goes
    assert usage(tmp_path) <= limit and len(chunk_files(tmp_path)) == 4

    def from_disk(doc: list[int]) -> int:
        return run(engine(model, tmp_path), Controller(doc + prompt(3, 2)))[0].disk_tokens

    assert (from_disk(a), from_disk(b), from_disk(c)) == (128, 0, 128)
    assert sorted(d.tokens for d in documents(tmp_path)) == [128, 128, 128]


def test_evict_removes_every_chain_through_a_removed_chunk(tmp_path: Path) -> None:
    model = tiny_model(seed=4)
    doc = prompt(200, 5)
    run(engine(model, tmp_path), Controller(doc + prompt(70, 6)))  # chunks 0-3 of one chain
    files = sorted(chunk_files(tmp_path), key=lambda p: read_header(p).index)
    assert len(files) == 4
    os.utime(files[1], ns=(1, 1))  # chunk 1 unused the longest
    evict(tmp_path, usage(tmp_path) - 1)
    assert [p.exists() for p in files] == [True, False, False, False]


def test_a_full_disk_turns_writes_off_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tier, "write_atomic", full)
    model = tiny_model(seed=4)
    _, ref = run(engine(model, None, caching=False), Controller(prompt(300, 1)))
    eng = engine(model, tmp_path)
    with pytest.warns(KVDiskWarning, match="the disk is full") as caught:
        seq, logits = run(eng, Controller(prompt(300, 1)))
    assert len(caught) == 1 and not eng.disk.writing
    assert all(torch.equal(x, y) for x, y in zip(logits, ref, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(eng, Controller(prompt(300, 2)))  # no second warning, no write tried
    assert chunk_files(tmp_path) == []
