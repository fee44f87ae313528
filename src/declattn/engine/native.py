"""Kernels compiled for this machine: the fused decode attention (``csrc/decode_attn.cpp``),
and ``build_library``/``load_op``, through which any kernel of the engine (one source
file, and the headers beside it) is built and loaded.

Why compiled here rather than shipped: a kernel is built with ``-march=native`` for the
CPU that runs it (AVX2, AVX-512 or NEON from one source), against the torch already
installed, so nothing is downloaded and no other torch build can be pulled in. The
first use compiles it (one ``c++`` call, no ninja, 20 s of CPU; about a minute on a busy
2-core machine) into ``<cache root>/kernels/<key>/``; the key covers the source (headers
included), the torch version, the compiler flags and the CPU's feature flags, so a
change of any of them builds afresh and a cache shared between machines never loads
code built for another CPU.

A compiler without OpenMP (Apple clang with no libomp) fails the build with
``-fopenmp``; it is then built once more without it, so the kernel still loads but runs
on one thread, and every use of that library says so in one warning (cause, cost, fix).
The failed attempt's log, kept at the OpenMP key, is what later processes go by: while
it is there they load the library built without OpenMP instead of failing again.

If it cannot be built at all (no compiler, a failing build), decode attention falls back
to torch ops, with one warning that names the cause and the fix.
``DECLATTN_DECODE_KERNEL=torch`` selects the fallback on purpose, without the warning.
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
STORE_SOURCE = Path(__file__).with_name("csrc") / "kv_store.cpp"
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c++17", "-fPIC",
          "-shared")
"""``-fopenmp``: torch's ``at::parallel_for`` is a header template that runs on several
threads only where the including file is compiled with OpenMP (torch's own build is);
without it a kernel ran on one thread whatever ``torch.set_num_threads`` said. The
library links the ``libgomp.so.1`` torch ships and has loaded, so one OpenMP runtime
serves both."""
OPENMP = "-fopenmp"
CFLAGS_NO_OPENMP = tuple(flag for flag in CFLAGS if flag != OPENMP)
"""The retry for a compiler that rejects ``-fopenmp``: a kernel that builds and loads but
runs on one thread is still far faster than the torch fallback."""
ENV_SWITCH = "DECLATTN_DECODE_KERNEL"

DecodeOp = Callable[..., Tensor]
"""``(q, kp, vp, runs, offsets, scale, min_split_rows, scoring=0) -> out``."""


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


def build_key(cxx: str, source: Path = SOURCE, flags: tuple[str, ...] = CFLAGS) -> str:
    """What a built library depends on, hashed: source and the headers beside it, torch,
    compiler, flags, CPU. The flags are those of the build, so one without OpenMP never
    passes for one with it."""
    h = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))
    for part in (
        source.read_bytes(),
        *(f"{p.name}\n".encode() + p.read_bytes() for p in headers),
        torch.__version__.encode(),
        cxx.encode(),
        " ".join(flags).encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _command(cxx: str, flags: tuple[str, ...], source: Path, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    cmd += [str(source), "-o", str(out)]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*cmd, "-lc10", "-ltorch_cpu"]


def _first_error(log: str) -> str:
    return next((ln.strip() for ln in log.splitlines() if "error" in ln), "") or "see log"


def _compile(cxx: str, flags: tuple[str, ...], source: Path, target: Path) -> Path:
    """Build ``target`` with ``flags`` unless it exists; on failure leave the compiler's
    output at ``<target>.log`` and raise.

    Concurrent builds are safe: each compiles to a temporary file and renames it into
    place, so a reader sees either no library or a whole one."""
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
        done = subprocess.run(_command(cxx, flags, source, tmp), capture_output=True, text=True)
        if done.returncode != 0:
            log = target.with_suffix(".log")
            log.write_text(done.stderr)
            raise KernelBuildError(f"{cxx} failed ({_first_error(done.stderr)}); log: {log}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _warn_one_thread(cxx: str, source: Path, log: Path) -> None:
    warnings.warn(
        f"declattn: {cxx} rejected {OPENMP} ({_first_error(log.read_text())}; log: {log}), "
        f"so {source.name} was built without it and its kernels run on one thread, whatever "
        "torch.set_num_threads says. Fix: install an OpenMP runtime (libomp, e.g. `brew "
        "install libomp`, or g++), or set CXX to a compiler with OpenMP; after installing, "
        f"delete {log} to rebuild with it.",
        RuntimeWarning,
        stacklevel=3,
    )


def build_library(source: Path, directory: Path | None = None) -> Path:
    """Compile a torch op library from one source file (unless already built for this key) into
    ``<directory or cache root/kernels>/<key>/<name>.so`` and return its path. Any kernel
    of the engine is built through here (one compiler policy, one cache layout).

    Built with ``CFLAGS``; if that fails, once more with ``CFLAGS_NO_OPENMP`` (one
    warning: one thread). The failed attempt's log stays at the OpenMP key, and while it
    is there and the library without OpenMP exists, that library is loaded straight away
    (with the warning again): a compiler without OpenMP would otherwise be asked to fail
    at every process start. Deleting the log (after installing OpenMP) tries again; a
    different compiler is a different key. Only a failure of both builds raises."""
    cxx = _compiler()
    root = directory if directory is not None else cache_root() / "kernels"
    name = f"{source.stem}.so"
    target = root / build_key(cxx, source) / name
    serial = root / build_key(cxx, source, CFLAGS_NO_OPENMP) / name
    failed = target.with_suffix(".log")
    if target.exists():
        return target
    if not (serial.exists() and failed.exists()):
        try:
            return _compile(cxx, CFLAGS, source, target)
        except KernelBuildError:
            pass
    _compile(cxx, CFLAGS_NO_OPENMP, source, serial)
    _warn_one_thread(cxx, source, failed)
    return serial


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


@functools.cache
def store_op() -> Callable[..., None] | None:
    """``torch.ops.declattn_kv.store_rows(kp, vp, k, v, row)`` (``csrc/kv_store.cpp``: a
    step's new keys and values into a layer's pools in one call), built on first use;
    ``None`` (after one warning) when it cannot be had, or when
    ``DECLATTN_DECODE_KERNEL=torch`` (the switch of the decode path it serves)."""
    return load_op(
        STORE_SOURCE,
        lambda: torch.ops.declattn_kv.store_rows,
        ENV_SWITCH,
        "new keys and values are stored by torch copies (about 1 ms more per decode step)",
    )


def decode_bf16_path() -> bool:
    """Whether the decode kernel built here takes bf16 queries over a bf16 pool through its
    AVX-512 BF16 path (``csrc/decode_attn_avx512.h``: 2x the portable path's speed on a
    Zen 5 core); ``False`` where the CPU or compiler lacks it, or there is no kernel."""
    return decode_op() is not None and bool(torch.ops.declattn.decode_bf16_path())


SCORINGS = {"machine": 0, "vdpbf16ps": 1, "fma": 2, "amx": 3}
"""The kernel's ``scoring`` argument: how its AVX-512 BF16 path scores keys and weights
values (the CPU's choice by default; the others for tests and
``scripts/decode_attn_profile.py``; ``amx`` is refused where the CPU, build or OS lacks
it)."""


def decode_scoring() -> str:
    """How the AVX-512 BF16 path works on this CPU: ``amx`` (AMX tiles, where the CPU has
    AMX-BF16 and Linux grants it: ``csrc/decode_attn_amx.h``), else ``vdpbf16ps`` (AMD) or
    ``fma`` (Intel, where a 512-bit ``vdpbf16ps`` is slower than two fp32 FMAs); ``""``
    where there is no such path."""
    return str(torch.ops.declattn.decode_scoring()) if decode_bf16_path() else ""
