"""A chunk file that is not what its name promises is never read as K/V: truncated,
bit-flipped, another model's or empty, it is detected, removed and its chunk computed
again (bit for bit a fresh prefill), with one warning per engine."""

from __future__ import annotations

import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_world import chunk_files, engine, run
from tiny_world import prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.kvdisk.chunkfile import read_header
from declattn.engine.kvdisk.tier import KVDiskWarning

DOC = prompt(300, 1)


def _data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def truncate(path: Path, _other: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_data_bit(path: Path, _other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[_data_start(path) + 1000] ^= 0x10
    path.write_bytes(bytes(data))


def flip_header_bit(path: Path, _other: Path) -> None:
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b'"index":"') + len(b'"index":"')
    data[at] ^= 0x01  # the chunk's index, "1" -> "0"
    path.write_bytes(bytes(data))


def empty(path: Path, _other: Path) -> None:
    path.write_bytes(b"")


def other_models_file(path: Path, other: Path) -> None:
    shutil.copyfile(other / path.name, path)  # same tokens, same name, other weights


@pytest.mark.parametrize(
    "damage", [truncate, flip_data_bit, flip_header_bit, empty, other_models_file]
)
def test_a_damaged_file_is_removed_and_recomputed_with_one_warning(
    tmp_path: Path, damage: Callable[[Path, Path], None]
) -> None:
    model = tiny_model(seed=4)
    q1, q2 = DOC + prompt(20, 2), DOC + prompt(25, 3)
    ours, theirs = engine(model, tmp_path), engine(tiny_model(seed=9), tmp_path)
    run(ours, Controller(q1))
    run(theirs, Controller(q1))  # another model's files, under the same names
    other_dir = tmp_path / theirs.disk.namespace.key
    files = {read_header(p).index: p for p in (tmp_path / ours.disk.namespace.key).glob("*.s*")}
    damage(files[1], other_dir)
    _, ref = run(engine(model, None, caching=False), Controller(q2))
    eng = engine(model, tmp_path)
    with pytest.warns(KVDiskWarning, match="damaged") as caught:
        seq, logits = run(eng, Controller(q2))
    assert len(caught) == 1
    assert seq.disk_tokens == 64  # chunk 0 only: the chain stops at the damaged one
    assert all(torch.equal(a, b) for a, b in zip(logits, ref, strict=True))
    assert read_header(files[1]).index == 1  # computed again and written back, whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is whole again: no warning
        again, _ = run(engine(model, tmp_path), Controller(q2))
    assert again.disk_tokens == 320  # and q2's own last whole chunk, written by the run above


def test_one_warning_per_engine_for_many_damaged_files(tmp_path: Path) -> None:
    model = tiny_model(seed=4)
    docs = [prompt(200, 10 + i) for i in range(3)]
    for d in docs:
        run(engine(model, tmp_path), Controller(d + prompt(5, 1)))
    for p in chunk_files(tmp_path):
        if read_header(p).index == 0:
            truncate(p, p)
    eng = engine(model, tmp_path)
    with pytest.warns(KVDiskWarning) as caught:
        for d in docs:
            seq, _ = run(eng, Controller(d + prompt(6, 2)))
            assert seq.cached_tokens == 0
    assert len(caught) == 1
