"""``declattn cache ls|du|rm|clear`` over a directory of chunk files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from declattn.cli import main
from declattn.engine.kvdisk.atomic import write_atomic
from declattn.engine.kvdisk.chunkfile import ChunkMeta, encode
from declattn.engine.kvdisk.identity import Namespace
from declattn.engine.kvdisk.store import chunk_path, ensure_namespace


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _document(root: Path, model: str, name: str, chunks: int, preview: str) -> str:
    """Write a chain of ``chunks`` chunk files; returns the document's id."""
    ns = Namespace(model, f"files:{model}", "float32", 16, 64, 64, 2, 2, 16, "e", "p")
    ensure_namespace(root, ns)
    parent = ""
    for j in range(chunks):
        digest = _digest(name, j)
        k, v = torch.full((2, 2, 64, 16), float(j)), torch.full((2, 2, 64, 16), -1.0)
        meta = ChunkMeta(ns.key, digest, parent, j, 64, 1.0e9, preview if j == 0 else "")
        write_atomic(chunk_path(root, ns.key, digest), encode(meta, k, v))
        parent = digest
    return _digest(name, 0)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_ls_lists_documents_by_model(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _document(root, "smol", "a", 3, "The keeper of the light")
    _document(root, "qwen", "b", 1, "A ledger of ships")
    code, out = _run(capsys, "cache", "ls", "--kv-cache-dir", str(root), "--json")
    assert code == 0
    docs = {d["id"]: d for d in json.loads(out)}
    assert docs[a]["model"] == "smol" and docs[a]["tokens"] == 192 and docs[a]["chunks"] == 3
    assert docs[a]["preview"] == "The keeper of the light"
    assert {d["model"] for d in docs.values()} == {"smol", "qwen"}
    code, out = _run(capsys, "cache", "ls", "--kv-cache-dir", str(root))
    assert code == 0 and a[:12] in out and "2 documents" in out


def test_du_sums_bytes_by_model(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _document(root, "smol", "a", 2, "x")
    code, out = _run(capsys, "cache", "du", "--kv-cache-dir", str(root))
    assert code == 0 and "smol" in out and "64.9 KiB" in out


def test_rm_removes_a_document_by_a_prefix_of_its_id(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _document(root, "smol", "a", 3, "x")
    b = _document(root, "smol", "b", 2, "y")
    code, out = _run(capsys, "cache", "rm", a[:8], "--kv-cache-dir", str(root))
    assert code == 0 and "removed 1 document(s)" in out
    code, out = _run(capsys, "cache", "ls", "--kv-cache-dir", str(root), "--json")
    assert [d["id"] for d in json.loads(out)] == [b]
    assert len(list(root.glob("*/*.safetensors"))) == 2
    code, out = _run(capsys, "cache", "rm", "ffffffffff", "--kv-cache-dir", str(root))
    assert code == 2 and "no cached document" in out


def test_clear_removes_everything_or_one_models(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _document(root, "smol", "a", 2, "x")
    _document(root, "qwen", "b", 2, "y")
    code, out = _run(capsys, "cache", "clear", "--model", "smol", "--kv-cache-dir", str(root))
    assert code == 0
    code, out = _run(capsys, "cache", "ls", "--kv-cache-dir", str(root), "--json")
    assert [d["model"] for d in json.loads(out)] == ["qwen"]
    code, out = _run(capsys, "cache", "clear", "--model", "gemma", "--kv-cache-dir", str(root))
    assert code == 2 and "nothing cached for model 'gemma'" in out
    assert _run(capsys, "cache", "clear", "--kv-cache-dir", str(root))[0] == 0
    assert not list(root.glob("*/*.safetensors"))


def test_the_size_flag_names_a_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--context", "x", "--question", "q", "--kv-cache-size", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err
