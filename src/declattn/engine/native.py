"""Kernels compiled for this machine: the fused decode attention (``csrc/decode_attn.cpp``),
and ``build_library``/``load_op``, through which any one-file kernel of the engine is
built and loaded.

Why compiled here rather than shipped: a kernel is built with ``-march=native`` for the
CPU that runs it (AVX2, AVX-512 or NEON from one source), against the torch already
installed, so nothing is downloaded and no other torch build can be pulled in. The
first use compiles it (one ``c++`` call, no ninja, 20 s of CPU; about a minute on a busy
2-core machine) into ``<cache root>/kernels/<key>/``; the key covers the source, the torch
version, the compiler flags and the CPU's feature flags, so a change of any of them
builds afresh and a cache shared between machines never loads code built for another
CPU.

If it cannot be built (no compiler, a failing build), decode attention falls back to
torch ops, with one warning that names the cause and the fix. ``DECLATTN_DECODE_KERNEL=torch``
selects the fallback on purpose, without the warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from declattn.engine.paths import cache_root

SOURCE = Path(__file__).with_name("csrc") / "decode_attn.cpp"
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c++17", "-fPIC",
          "-shared")
"""``-fopenmp``: torch's ``at::parallel_for`` is a header template that runs on several
threads only where the including file is compiled with OpenMP (torch's own build is);
without it a kernel ran on one thread whatever ``torch.set_num_threads`` said. The
library links the ``libgomp.so.1`` torch ships and has loaded, so one OpenMP runtime
serves both."""
ENV_SWITCH = "DECLATTN_DECODE_KERNEL"

DecodeOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, int], Tensor]


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded; the message says why."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    return cxx


def build_key(cxx: str, source: Path = SOURCE) -> str:
    """What a built library depends on, hashed: source, torch, compiler, flags, CPU."""
    h = hashlib.sha256()
    for part in (source.read_bytes(), torch.__version__.encode(), cxx.encode(),
                 " ".join(CFLAGS).encode(), platform.machine().encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _command(cxx: str, source: Path, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    cmd += [str(source), "-o", str(out)]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*cmd, "-lc10", "-ltorch_cpu"]


def build_library(source: Path, directory: Path | None = None) -> Path:
    """Compile a one-file torch op library (unless already built for this key) into
    ``<directory or cache root/kernels>/<key>/<name>.so`` and return its path.

    Concurrent builds are safe: each compiles to a temporary file and renames it into
    place, so a reader sees either no library or a whole one. Any kernel of the engine
    is built through here (one compiler policy, one cache layout)."""
    cxx = _compiler()
    root = directory if directory is not None else cache_root() / "kernels"
    target = root / build_key(cxx, source) / f"{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.write(
        f"declattn: compiling {source.name} into {target.parent} (once per machine; about "
        "a minute)\n"
    )
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        done = subprocess.run(_command(cxx, source, tmp), capture_output=True, text=True)
        if done.returncode != 0:
            log = target.with_suffix(".log")
            log.write_text(done.stderr)
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), "")
            raise KernelBuildError(f"{cxx} failed ({first.strip() or 'see log'}); log: {log}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load_op(source: Path, op: Callable[[], object], env_switch: str, fallback: str) -> Any:
    """Build and load ``source``, then return ``op()`` (the registered torch op); ``None``
    when ``env_switch`` is ``torch`` (chosen: no warning), or after one warning naming the
    cause, what ``fallback`` costs, and the fix, when the op cannot be had."""
    choice = os.environ.get(env_switch, "native").lower()
    if choice == "torch":
        return None
    if choice != "native":
        raise ValueError(f"{env_switch} must be 'native' or 'torch', not {choice!r}")
    try:
        torch.ops.load_library(str(build_library(source)))
        return op()
    except (KernelBuildError, OSError, RuntimeError) as exc:
        warnings.warn(
            f"declattn: {source.name} unavailable ({exc}); {fallback}. Fix: install a C++ "
            f"compiler (g++), or set {env_switch}=torch to choose the fallback and silence "
            "this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


@functools.cache
def decode_op() -> DecodeOp | None:
    """``torch.ops.declattn.decode_attention``, building it on first use; ``None`` (after
    one warning) when it cannot be had, or when ``DECLATTN_DECODE_KERNEL=torch``."""
    return load_op(
        SOURCE,
        lambda: torch.ops.declattn.decode_attention,
        ENV_SWITCH,
        "decode attention runs on torch ops, several times slower",
    )
