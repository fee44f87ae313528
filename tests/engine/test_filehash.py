"""A model file's digest: hashed once per version of its bytes, and of a directory only
what is the model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from declattn.engine import filehash
from declattn.engine.filehash import file_digest


def test_a_model_file_is_hashed_once_per_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"a" * 1000)
    stamps = tmp_path / "stamps"
    first = file_digest(f, stamps)
    assert len(list(stamps.iterdir())) == 1
    monkeypatch.setattr(filehash, "sha256_files", lambda *a: pytest.fail("hashed again"))
    assert file_digest(f, stamps) == first  # a stat, not a read
    monkeypatch.undo()
    f.write_bytes(b"GGUF" + b"b" * 1000)  # same size, new bytes and time
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)
    assert file_digest(f, stamps) != first


def test_a_directory_model_covers_its_config_and_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "README.md").write_text("not the model")
    before = file_digest(tmp_path, tmp_path / "s1")
    (tmp_path / "README.md").write_text("still not the model")
    assert file_digest(tmp_path, tmp_path / "s2") == before
    (tmp_path / "config.json").write_text('{"rope_theta": 1}')
    assert file_digest(tmp_path, tmp_path / "s3") != before
