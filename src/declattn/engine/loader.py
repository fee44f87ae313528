"""Load a model from a Hugging Face directory or a GGUF file.

A GGUF file is converted once into a Hugging Face directory in the user's cache
(``$XDG_CACHE_HOME`` or ``~/.cache``, then ``declattn/converted/<key>``); every load then
goes through the one Hugging Face path. Dequantising and, above all, building a tokenizer
from GGUF metadata take tens of seconds; reading the converted directory takes a few.

On a CPU a GGUF's matrices load, by default, as packed layers that keep the file's own
blocks (``engine.quant``; cached beside the converted directory): a decode step reads
every weight once, and 4.5-8.5 bits a weight is a third to a half of bf16's bytes.
Asking for a ``dtype`` loads every weight dense in that dtype, as before.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from declattn.da.options import MODEL_SETTINGS_FILE
from declattn.engine.filehash import file_digest
from declattn.engine.gguf_convert import GGUFError, GGUFUnsupported, hf_tensors, open_gguf
from declattn.engine.hf_tokenizer import directory_tokenizer, keep_special_flags
from declattn.engine.models.config import ConfigError, ModelConfig, UnsupportedArchitecture
from declattn.engine.models.decoder import Decoder
from declattn.engine.models.hf_names import internal_name
from declattn.engine.paths import cache_root
from declattn.engine.quant.fuse import fuse_gguf_projections
from declattn.engine.quant.gguf_weights import QuantPolicy
from declattn.engine.quant.linear import QuantLinear
from declattn.engine.quant.store import QuantSummary, install, load_packed
from declattn.engine.route import choose_route

CONVERTER_VERSION = "2"
"""Part of every cache key: bump it when the conversion's output changes."""
STAMPS_DIR = ".stamps"
"""Under a conversions root: the GGUFs' digests (``filehash.file_digest``)."""

_GGUF_MAGIC = b"GGUF"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LoadError(Exception):
    """A model could not be loaded; the message names the file and the problem."""


class ModelNotFoundError(LoadError):
    """The path, or the packaged file, does not exist."""


class UnsupportedModelError(LoadError):
    """A readable model this engine does not implement (architecture or feature)."""


class CorruptModelError(LoadError):
    """A file that should hold a model but is truncated or not in the expected format."""


class IncompleteModelError(LoadError):
    """A directory that lacks config.json, weights, or some of the model's tensors."""


class InvalidConfigError(LoadError):
    """A config.json with a required field missing or a value out of range."""


@dataclass
class LoadedModel:
    """A ready model and what came with it.

    ``tokenizer`` is ``None`` only for a Hugging Face directory that has no tokenizer files
    (test checkpoints). ``weights_dir`` is the directory actually read: the converted cache
    entry for a GGUF. ``cache_hit`` tells whether a GGUF's conversion was found in the cache
    (``None`` for a Hugging Face directory). ``quant`` says which matrices were loaded
    packed, and from what (``None``: every weight is dense).
    """

    model: Decoder
    config: ModelConfig
    tokenizer: Any
    source: Path
    weights_dir: Path | None = None
    cache_hit: bool | None = None
    quant: QuantSummary | None = None


def default_device() -> torch.device:
    """CUDA when present: the engine's other kernels assume one device per process."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """bf16 where the hardware computes it natively, fp32 otherwise."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else torch.float32


def converted_cache_root() -> Path:
    """``cache_root()/converted``: the user's cache, not the repo."""
    return cache_root() / "converted"


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    quantize: bool | None = None,
    policy: QuantPolicy | None = None,
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Load a Hugging Face model directory or a ``.gguf`` file.

    ``dtype`` defaults to ``default_dtype(device)``, ``device`` to CUDA when present.
    ``quantize``: ``None`` packs a GGUF's matrices when no ``dtype`` is asked for and the
    device is a CPU (the packed kernels are CPU kernels); ``True`` insists (an error for
    a directory of dense weights or a GPU); ``False`` loads dense. With packed matrices,
    ``dtype`` is that of the activations, norms, embedding and KV cache: bf16 by default
    even where the CPU has no native bf16, since it halves the KV bytes a step reads and
    torch's int4/int8 fallback kernels are vectorised for bf16 only (fp32 is many times
    slower on AVX2; the GGUF kernel takes either). ``policy`` chooses the kernel per GGUF
    format (``QuantPolicy()`` by default). ``cache_dir`` overrides
    ``converted_cache_root()`` for GGUF conversions.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise ModelNotFoundError(f"{source}: no such file or directory")
    source = source.resolve()
    dev = torch.device(device) if device is not None else default_device()
    packed = _wants_packed(source, quantize, dtype, dev)
    dt = dtype if dtype is not None else torch.bfloat16 if packed else default_dtype(dev)
    if source.is_dir():
        model, config, tokenizer, _ = _load_hf_dir(source, dt, dev)
        return LoadedModel(model, config, tokenizer, source, weights_dir=source)
    if not _is_gguf(source):
        raise CorruptModelError(
            f"{source}: not a GGUF file (no GGUF magic) and not a model directory"
        )
    root = Path(cache_dir) if cache_dir is not None else converted_cache_root()
    converted, hit = _converted_dir(source, root)
    quant = (policy or QuantPolicy(), source) if packed else None
    model, config, tokenizer, summary = _load_hf_dir(converted, dt, dev, source, quant)
    return LoadedModel(
        model, config, tokenizer, source, weights_dir=converted, cache_hit=hit, quant=summary
    )


def _wants_packed(
    source: Path, quantize: bool | None, dtype: torch.dtype | None, device: torch.device
) -> bool:
    if quantize is False:
        return False
    if quantize is None:
        return source.is_file() and dtype is None and device.type == "cpu"
    if source.is_dir():
        raise UnsupportedModelError(
            f"{source}: packed weights are read from a GGUF's own blocks, and a directory "
            "holds dense ones; load it without quantize=True"
        )
    if device.type != "cpu":
        raise UnsupportedModelError(
            f"{source}: the packed weight kernels run on a CPU, not {device.type}; "
            "load with quantize=False (or --dtype bf16)"
        )
    return True


def find_packaged_gguf(dist_name: str, filename_glob: str) -> Path:
    """Locate a GGUF shipped inside an installed distribution, without importing it.

    Some model packages do real work on import (or need dependencies that were not
    installed); their file lists in the distribution metadata are enough.
    """
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"distribution {dist_name!r} is not installed") from None
    for file in dist.files or []:
        if fnmatch(file.name, filename_glob):
            located = Path(str(dist.locate_file(file)))
            if located.is_file():
                return located.resolve()
            raise ModelNotFoundError(f"{located}: listed by {dist_name!r} but missing on disk")
    raise ModelNotFoundError(f"distribution {dist_name!r} has no file matching {filename_glob!r}")


def cache_key(path: Path, root: Path) -> str:
    """A GGUF's conversion, by content (the file's sha256, stamped under ``root/.stamps``)
    and converter version: a copy or an export of the same bytes finds it."""
    ident = f"{file_digest(path, root / STAMPS_DIR)}\0{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def conversion_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """Where the conversion of ``gguf_path`` lives under ``root`` (default
    ``converted_cache_root()``); it is complete once it holds ``config.json``."""
    root = root if root is not None else converted_cache_root()
    return root / cache_key(gguf_path, root)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _converted_dir(gguf_path: Path, cache_root: Path) -> tuple[Path, bool]:
    """The cache entry for ``gguf_path``, converting first when absent."""
    final = conversion_dir(gguf_path, cache_root)
    if (final / "config.json").is_file():
        return final, True
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=cache_root))
    try:
        _convert_gguf(gguf_path, tmp)
        if final.exists() and not (final / "config.json").is_file():
            shutil.rmtree(final, ignore_errors=True)  # a stray incomplete entry
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent conversion: real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, False


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write ``out`` as a Hugging Face directory: config.json, model.safetensors, tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    try:
        gg = open_gguf(gguf_path)
        try:
            ModelConfig.from_hf(gg.config)
        except ConfigError as e:
            raise GGUFUnsupported(str(e)) from e
        tensors = {name: torch.from_numpy(data) for name, data in hf_tensors(gg)}
    except GGUFUnsupported as e:
        raise UnsupportedModelError(f"{gguf_path}: {e}") from e
    except GGUFError as e:
        raise CorruptModelError(f"{gguf_path}: {e}") from e
    except ValueError as e:  # dequantisation of a damaged block
        raise CorruptModelError(f"{gguf_path}: cannot dequantise ({e})") from e
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    if gg.has_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name
            )
        except Exception as e:  # transformers raises many kinds here
            raise UnsupportedModelError(f"{gguf_path}: cannot build its tokenizer ({e})") from e
        tokenizer.save_pretrained(str(out))
        keep_special_flags(tokenizer, out / "tokenizer_config.json")
    if gg.settings is not None:  # a model trained to declare knows its protocol
        (out / MODEL_SETTINGS_FILE).write_text(json.dumps(gg.settings, indent=2) + "\n")
    source = {"gguf": str(gguf_path), "converter_version": CONVERTER_VERSION}
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    # config.json last: its presence marks a complete entry.
    (out / "config.json").write_text(json.dumps(gg.config, indent=2) + "\n")


def _load_hf_dir(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device,
    origin: Path | None = None,
    quant: tuple[QuantPolicy, Path] | None = None,
) -> tuple[Decoder, ModelConfig, Any, QuantSummary | None]:
    """``quant``: the policy and the GGUF whose matrices go in packed (a GGUF's converted
    directory only)."""
    where = origin or directory
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise IncompleteModelError(f"{directory}: no config.json (not a model directory)")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"{config_path}: unreadable ({e})") from e
    try:
        config = ModelConfig.from_hf(raw)
    except UnsupportedArchitecture as e:
        raise UnsupportedModelError(f"{where}: {e}") from e
    except ConfigError as e:
        raise InvalidConfigError(f"{config_path}: {e}") from e
    with torch.device("meta"):
        model = Decoder(config)
    summary, packed_state, skip = None, {}, set()
    if quant is not None:
        policy, gguf_path = quant
        layers, summary = _packed_layers(directory, gguf_path, config, dtype, policy)
        skip = install(model, layers)
        packed_state = {
            f"{path}.{name}": buf for path, layer in layers.items()
            for name, buf in layer.named_buffers()
        }
    state = _read_weights(directory, config, dtype, device, skip)
    state.update(packed_state)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise IncompleteModelError(f"{directory}: {len(missing)} tensors missing ({shown})")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise IncompleteModelError(f"{directory}: weights do not fit the config ({e})") from e
    if quant is not None:
        fuse_gguf_projections(model)  # q/k/v, gate/up one call each
    model.eval()
    choose_route(model)  # how its decode steps run, and why
    return model, config, _load_tokenizer(directory, where), summary


def _packed_layers(
    directory: Path, gguf_path: Path, config: ModelConfig, dtype: torch.dtype,
    policy: QuantPolicy,
) -> tuple[dict[str, QuantLinear], QuantSummary]:
    try:
        return load_packed(directory, gguf_path, config, dtype, policy)
    except GGUFUnsupported as e:
        raise UnsupportedModelError(f"{gguf_path}: {e}") from e
    except (GGUFError, ValueError) as e:
        raise CorruptModelError(f"{gguf_path}: cannot read its blocks ({e})") from e


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CorruptModelError(f"{index}: unreadable ({e})") from e
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise IncompleteModelError(f"{directory}: shards missing: {', '.join(absent)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise IncompleteModelError(f"{directory}: no *.safetensors weights")
    return files


def _read_weights(
    directory: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    skip: set[str] | frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The dense tensors, by ``Decoder`` name, except those in ``skip`` (never read)."""
    from safetensors import SafetensorError, safe_open

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    try:
                        name = internal_name(config, key)
                    except KeyError:
                        raise UnsupportedModelError(
                            f"{file}: unexpected tensor {key!r} for {config.architecture}"
                        ) from None
                    if name is not None and name not in skip:
                        state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise CorruptModelError(f"{file}: unreadable safetensors ({e})") from e
    return state


def _load_tokenizer(directory: Path, where: Path) -> Any:
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return directory_tokenizer(directory)
    except Exception as e:  # transformers raises many kinds here
        raise CorruptModelError(f"{where}: cannot load tokenizer ({e})") from e
