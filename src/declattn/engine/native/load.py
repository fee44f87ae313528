"""Loading the native extension once per process: the best variant built into the package
for this CPU, else one built here at first use, and what was loaded and why.

The order, and why:

1. the package's own build (``lib/``, made by ``setup.py`` at install, or in place by
   ``pip install -e .``), the best variant this CPU runs, while the sources and torch are
   still the ones it was built from (a checkout whose C++ changed since is rebuilt);
2. else a build at first use (a checkout nobody built, changed sources, another torch, a
   CPU below every shipped variant): the variant this CPU would load, or ``-march=native``
   where none fits, into ``<cache root>/kernels/<key>/`` (``build.py``);
3. else nothing: the callers run their torch code, after one warning that names the cause
   and the fix.

``DECLATTN_NATIVE`` picks: ``auto`` (the default), ``jit`` (skip the package's build),
``native`` (build with ``-march=native``), or a variant's name (that one, from the package
or built; an error where the CPU cannot run it). One process loads one library: the op
namespace is defined once.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from declattn.engine.native.build import (
    KernelBuildError,
    Manifest,
    build,
    build_key,
    compiler,
    compiler_id,
    openmp_works,
    sources_key,
)
from declattn.engine.native.variants import (
    Variant,
    best,
    by_name,
    cpu_flags,
    native_variant,
    shipped,
)
from declattn.engine.paths import cache_root

PACKAGE_LIB = Path(__file__).resolve().parent / "lib"
"""Where ``setup.py`` puts the variants it builds (a wheel's, or a checkout's in place)."""
ENV_CHOICE = "DECLATTN_NATIVE"


@dataclass(frozen=True)
class Library:
    """The loaded extension: which variant, from where, why that one, and what its build
    says it was compiled for (``build_info``: the library's word, not a file name's)."""

    variant: str
    origin: str
    """``package`` (built at install) or ``jit`` (built at first use, in the cache)."""
    path: Path
    why: str
    isa: tuple[str, ...]

    @property
    def openmp(self) -> bool:
        return "openmp" in self.isa

    def describe(self) -> str:
        """One line: ``avx512_bf16 (package: ...so): why``."""
        return f"{self.variant} ({self.origin}: {self.path}): {self.why}"


class NativeUnavailable(RuntimeError):
    """No library could be had; the message says why and what to do."""


def _choice() -> str:
    return os.environ.get(ENV_CHOICE, "auto").strip().lower() or "auto"


def _packaged(cpu: frozenset[str], choice: str) -> tuple[Path, Variant] | str:
    """The package's library to load, or why none: a sentence for ``Library.why``."""
    manifest = Manifest.read(PACKAGE_LIB)
    if manifest is None:
        return "no build in the package (a source checkout: `pip install -e .` builds it)"
    if manifest.sources != sources_key():
        return "the C++ sources changed since the package's build"
    if manifest.torch != torch.__version__:
        return f"the package was built against torch {manifest.torch}, not {torch.__version__}"
    built = tuple(by_name(n) for n in manifest.variants)
    pick = by_name(choice) if choice != "auto" else best(built, cpu)
    if pick is None or pick.name not in manifest.variants:
        built_names = ", ".join(manifest.variants)
        return f"no variant in the package runs on this CPU (built: {built_names})"
    return PACKAGE_LIB / manifest.variants[pick.name], pick


def _jit(cpu: frozenset[str], choice: str) -> tuple[Path, Variant]:
    """This CPU's variant (or ``-march=native``) built into the cache, unless there."""
    if choice == "native":
        variant: Variant | None = native_variant(cpu)
    else:
        variant = best(shipped(), cpu) if choice in ("auto", "jit") else by_name(choice)
    variant = variant or native_variant(cpu)
    cxx = compiler()
    root = cache_root() / "kernels"
    cid = compiler_id(cxx)
    with_omp = root / build_key(variant, cid, torch.__version__, True)
    without = root / build_key(variant, cid, torch.__version__, False)
    name = f"declattn_{variant.name}.so"
    for directory in (with_omp, without):  # a build without OpenMP: its probe failed once
        if (directory / name).exists():
            return directory / name, variant
    target = with_omp if openmp_works(cxx, root) else without
    build((variant,), target, rpath=True)
    return target / name, variant


def _open(path: Path, variant: Variant, origin: str, why: str) -> Library:
    torch.ops.load_library(str(path))
    info = tuple(torch.ops.declattn.build_info())
    if not info or info[0] != variant.name:
        raise NativeUnavailable(f"{path} holds variant {info[:1]}, not {variant.name}")
    return Library(variant.name, origin, path, why, info[1:])


def _load() -> Library:
    choice = _choice()
    cpu = cpu_flags()
    if choice not in ("auto", "jit", "native"):
        wanted = by_name(choice)  # ValueError for an unknown name
        if cpu and not wanted.runs_on(cpu):
            missing = ", ".join(sorted(wanted.needs - cpu))
            raise ValueError(f"{ENV_CHOICE}={choice}: this CPU lacks {missing}")
    why_not = f"{ENV_CHOICE}={choice}"
    if choice not in ("jit", "native"):
        found = _packaged(cpu, choice)
        if isinstance(found, str):
            why_not = found
        else:
            path, variant = found
            why = "chosen by DECLATTN_NATIVE" if choice != "auto" else "the best this CPU runs"
            try:
                return _open(path, variant, "package", why)
            except OSError as exc:  # the loader refused it: nothing was registered
                why_not = f"the package's {path.name} did not load ({exc})"
                _warn(f"{why_not}; building one for this CPU instead. Fix: reinstall declattn "
                      f"for torch {torch.__version__}")
    path, variant = _jit(cpu, choice)
    return _open(path, variant, "jit", f"built at first use: {why_not}")


def _warn(message: str) -> None:
    warnings.warn(f"declattn: {message}", RuntimeWarning, stacklevel=4)


def _fix(exc: Exception) -> str:
    """What to do about a failed build, by its cause."""
    text = str(exc)
    if "no C++ compiler" in text:
        return "install g++ (or set CXX), or install a declattn wheel built for this platform"
    missing = re.search(r"fatal error: ([\w./-]+): No such file or directory", text)
    if missing:
        return (f"the package's C++ sources are incomplete ({missing.group(1)} is missing): "
                "reinstall declattn")
    return "see the log it names"


@functools.cache
def library() -> Library | None:
    """The extension, loaded on first call; ``None`` (after one warning) where it cannot
    be had. Raises ``ValueError`` for a ``DECLATTN_NATIVE`` that names no variant this CPU
    runs: asked for by name, it is an error, not a fallback."""
    try:
        lib = _load()
    except (KernelBuildError, NativeUnavailable, OSError, RuntimeError) as exc:
        _warn(f"the native kernels are unavailable ({exc}), so decode attention, the GGUF "
              "matmul, RMSNorm/RoPE and the decode-layer ops run on torch ops (several times "
              f"slower). Fix: {_fix(exc)}; or set DECLATTN_DECODE_KERNEL, "
              "DECLATTN_GGUF_KERNEL and DECLATTN_LAYER_KERNEL to torch to choose that and "
              "silence this.")
        return None
    if not lib.openmp:
        again = (f"delete {lib.path.parent} to rebuild" if lib.origin == "jit"
                 else "reinstall declattn")
        _warn(f"{lib.path} was built without OpenMP (the compiler rejected -fopenmp), so its "
              "kernels run on one thread whatever torch.set_num_threads says. Fix: install an "
              "OpenMP runtime (libomp, e.g. `brew install libomp`, or g++), or set CXX to a "
              f"compiler with OpenMP; then {again}.")
    return lib
