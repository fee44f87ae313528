"""What makes stored K/V bytes differ besides the tokens, hashed into a namespace key.

A chunk file is named by the chained digest of its tokens (``blocks.block_digests``),
which says nothing about who computed it. Everything else that decides its bytes names
the directory it lives in, so that a change of any of them misses instead of matching:

- the model: its config as loaded, a sha256 of its files (read once per version of
  them, then kept in a stamp under their path, size, inode and modification time), and a
  fingerprint of the weights as loaded (every tensor's name, dtype and shape and its
  first and last 4 KiB: packed or dense, the dtype, an adapter added in memory). A model
  with no files (random weights in tests) is hashed whole;
- the KV pool: dtype, block size, layers, KV heads, head size; the prefill chunk and
  budget (where a prompt's pieces start decides the summation order, see
  ``engine/prefix.py``);
- the engine's own source (every ``.py`` and C++ file under ``engine/``): a code change
  that could change a bit can never be forgotten the way a version number can; a
  release only changes it on upgrade;
- the platform: torch's version, the CPU's architecture, ISA level and feature flags
  (the native kernels are built for them), the device;
- the thread count, where the K/V is fp32 only: MKL's fp32 GEMMs on Intel CPUs split
  their sums by the thread count (a 64 x 1024 x 1024 product differs in its last bits
  between 1 and 2 threads on a Xeon), so fp32 K/V computed with 2 threads is not what 1
  thread computes. bf16 K/V does not depend on it (tested on a dense bf16 model), so any
  thread count shares it (``tests/engine/kvdisk/test_kvdisk_identity.py`` holds both).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from declattn.engine.filehash import file_digest
from declattn.engine.models import Decoder

_SAMPLE = 4096  # bytes of each tensor's start and end in a weights fingerprint
_SOURCE_SUFFIXES = (".py", ".cpp", ".cc", ".c", ".h", ".hpp")
ENGINE_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Namespace:
    """Everything a chunk file's bytes depend on besides its tokens."""

    model_name: str
    """For listings only: the same file under another name gives the same K/V."""
    model: str
    kv_dtype: str
    block_size: int
    prefill_chunk: int
    prefill_budget: int
    layers: int
    kv_heads: int
    head_dim: int
    engine: str
    platform: str
    threads: int = 0
    """torch's thread count for fp32 K/V (see above), 0 for any other dtype."""

    @functools.cached_property
    def key(self) -> str:
        """32 hex digits naming the namespace's directory."""
        fields = asdict(self)
        del fields["model_name"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"key": self.key}


def weights_fingerprint(model: nn.Module, *, full: bool) -> str:
    """sha256 over every tensor of ``model``'s state: name, dtype, shape and bytes (all of
    them when ``full``, else the first and last 4 KiB of each)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if not full and raw.numel() > 2 * _SAMPLE:
            raw = torch.cat([raw[:_SAMPLE], raw[-_SAMPLE:]])
        h.update(raw.cpu().numpy().tobytes())
    return h.hexdigest()


def model_identity(model: Decoder, source: Path | None, stamps: Path) -> str:
    """The model's part of a namespace: its config as loaded, its files' digest and its
    weights' fingerprint, or, with no ``source`` file, every byte of its weights."""
    config = f"config:{hashlib.sha256(repr(model.config).encode()).hexdigest()}"
    if source is None:
        return f"{config} weights:{weights_fingerprint(model, full=True)}"
    files = file_digest(source, stamps)
    return f"{config} files:{files} weights:{weights_fingerprint(model, full=False)}"


@functools.cache
def engine_digest() -> str:
    """sha256 of the engine's source files (Python and C++), by relative path."""
    files = sorted(p for p in ENGINE_DIR.rglob("*") if p.suffix in _SOURCE_SUFFIXES)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(ENGINE_DIR).as_posix()}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@functools.cache
def _cpu_flags_digest() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))]
    return hashlib.sha256((lines[0] if lines else "").encode()).hexdigest()[:16]


def threads_identity(kv_dtype: torch.dtype) -> int:
    """The thread count fp32 K/V depends on (see the module's docstring); 0 otherwise."""
    return torch.get_num_threads() if kv_dtype == torch.float32 else 0


def platform_identity(device: torch.device) -> str:
    """torch's version, the CPU (architecture, ISA level, feature flags) and the device."""
    parts = [
        f"torch {torch.__version__}",
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        f"cpu flags {_cpu_flags_digest()}",
        device.type,
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    return ", ".join(parts)
