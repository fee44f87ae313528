"""Compiling the native extension: every source in ``csrc/`` for one or more CPU variants,
in parallel, into one torch op library per variant, with a manifest of what was built from
what.

One compiler policy for both builds that use it: ``setup.py`` at install (every variant
the package ships, into the package) and ``load.py`` at first use in a source checkout
that has none built (the variant this CPU runs, into the cache). The same variant built
either way is the same code, so a checkout and an installed wheel compute the same bits.

Objects are kept by a key of everything they depend on (the sources and headers, the
flags, the compiler, torch), so a build whose objects exist only links, and two variants
that share objects (``Variant.shares``) compile them once. Compiles and links write a
temporary file and rename it into place: concurrent builds never see half a file.

Standard library at import, and only relative imports: ``setup.py`` loads this directory
as a package of its own, without importing ``declattn``; torch is asked for its include
and library paths when a build starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

# relative: setup.py loads this folder as a package of its own, without declattn's imports
from .variants import CSRC, Variant, by_name

COMPILE = ("-O3", "-ffp-contract=fast", "-std=c++17", "-fPIC")
OPENMP = "-fopenmp"
"""torch's ``at::parallel_for`` is a header template that runs on several threads only
where the including file is compiled with OpenMP; the library then links the
``libgomp.so.1`` torch ships and has loaded, so one OpenMP runtime serves both. A compiler
without it (Apple clang with no libomp) builds without: the kernels run on one thread,
and the loader says so (``load.py``)."""
NAMER = "library.cpp"
"""The source that defines the op namespace and names the variant (``-DDECLATTN_VARIANT``)."""
MANIFEST = "manifest.json"


class KernelBuildError(RuntimeError):
    """The extension could not be compiled; the message says why, and where the log is."""


@dataclass(frozen=True)
class Manifest:
    """What a directory of built variants holds and what it was built from: the loader
    takes a variant only while the sources and torch are still these."""

    sources: str
    torch: str
    compiler: str
    openmp: bool
    variants: dict[str, str]
    """Variant name -> its library's file name, in the directory."""

    def save(self, directory: Path) -> None:
        _atomic_write(directory / MANIFEST, json.dumps(asdict(self), indent=1).encode())

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        try:
            return cls(**json.loads((directory / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    return cxx


def compiler_id(cxx: str) -> str:
    """``cxx`` and its version line: a compiler upgraded in place builds afresh."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx} ({exc})") from exc
    lines = (done.stdout or done.stderr or "").splitlines()
    return f"{cxx} {lines[0] if lines else ''}"


def sources_key(csrc: Path = CSRC) -> str:
    """A hash of every source and header (names and bytes): any change, any file."""
    h = hashlib.sha256()
    for p in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _hash(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def build_key(variant: Variant, cxx_id: str, torch_version: str, openmp: bool,
              csrc: Path = CSRC) -> str:
    """What a variant's library depends on: sources, flags, the CPU flags it needs (a
    ``native`` build is for one CPU), compiler, torch, OpenMP."""
    return _hash(sources_key(csrc), variant.flags, sorted(variant.needs), cxx_id,
                 torch_version, openmp)


def _publish(tmp: str, path: Path) -> None:
    """``tmp`` (``mkstemp``'s, private) renamed to ``path``, readable by all as any
    installed file is."""
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    _publish(tmp, path)


def _first_error(log: str) -> str:
    return next((ln.strip() for ln in log.splitlines() if "error" in ln), "") or "see log"


def _run(cmd: list[str], target: Path, what: str) -> None:
    """Run ``cmd`` (which writes ``{tmp}``) and rename its output to ``target``; on failure
    keep the compiler's output at ``<target>.log`` and raise."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        done = subprocess.run([c.replace("{tmp}", tmp) for c in cmd], capture_output=True,
                              text=True)
        if done.returncode != 0:
            log = target.with_name(target.name + ".log")
            log.write_text(" ".join(cmd) + "\n\n" + done.stderr)
            raise KernelBuildError(f"{cmd[0]} failed on {what} ({_first_error(done.stderr)}); "
                                   f"log: {log}")
        _publish(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


@dataclass(frozen=True)
class Toolchain:
    """The compiler and torch a build uses, asked once."""

    cxx: str
    cxx_id: str
    torch_version: str
    includes: tuple[str, ...]
    libraries: tuple[str, ...]
    abi: int
    openmp: bool

    @classmethod
    def find(cls, scratch: Path) -> Toolchain:
        import torch
        from torch.utils import cpp_extension

        cxx = compiler()
        return cls(cxx, compiler_id(cxx), torch.__version__,
                   tuple(cpp_extension.include_paths()), tuple(cpp_extension.library_paths()),
                   int(torch._C._GLIBCXX_USE_CXX11_ABI), openmp_works(cxx, scratch))

    def compile_cmd(self, source: Path, flags: tuple[str, ...]) -> list[str]:
        cmd = [self.cxx, *COMPILE, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={self.abi}"]
        cmd += [OPENMP] if self.openmp else []
        for inc in self.includes:
            cmd += ["-isystem", inc]
        return [*cmd, "-c", str(source), "-o", "{tmp}"]

    def link_cmd(self, objects: list[Path], rpath: bool) -> list[str]:
        cmd = [self.cxx, "-shared", *([OPENMP] if self.openmp else []), *map(str, objects)]
        cmd += ["-o", "{tmp}"]
        for lib in self.libraries:
            cmd += [f"-L{lib}"] + ([f"-Wl,-rpath,{lib}"] if rpath else [])
        return [*cmd, "-lc10", "-ltorch_cpu"]


def openmp_works(cxx: str, scratch: Path) -> bool:
    """Whether ``cxx`` builds a shared library with ``-fopenmp`` (a tiny one)."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        src = Path(tmp) / "omp.cpp"
        src.write_text("#include <omp.h>\nint threads() { return omp_get_max_threads(); }\n")
        cmd = [cxx, OPENMP, "-shared", "-fPIC", str(src), "-o", str(Path(tmp) / "omp.so")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _unit_flags(variant: Variant, source: str) -> tuple[str, ...]:
    """The flags ``source`` is compiled with for ``variant``: a source it shares with
    another variant gets that one's (the same object); ``library.cpp`` its name too."""
    owner = variant
    if variant.shares is not None and source not in (*variant.own, NAMER):
        owner = by_name(variant.shares)
    named = (f"-DDECLATTN_VARIANT={variant.name}",) if source == NAMER else ()
    return owner.flags + named


def build(
    variants: tuple[Variant, ...],
    out: Path,
    *,
    objects: Path | None = None,
    rpath: bool = False,
    jobs: int | None = None,
    csrc: Path = CSRC,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> Manifest:
    """Build ``variants`` into ``out`` (``<name>.so`` each and the manifest), compiling
    their objects into ``objects`` (default ``out/obj``) with ``jobs`` compiles at a time
    (default: ``MAX_JOBS`` or the CPU count). ``rpath``: the library finds torch's by
    the path it was built against (a cache build; an installed package's libraries find
    torch's already loaded). Raises ``KernelBuildError`` on the first failure."""
    out.mkdir(parents=True, exist_ok=True)
    objects = objects if objects is not None else out / "obj"
    objects.mkdir(parents=True, exist_ok=True)
    tc = Toolchain.find(objects)
    key = sources_key(csrc)
    sources = sorted(csrc.glob("*.cpp"))
    units: dict[Path, list[str]] = {}
    plan: list[tuple[Variant, list[Path]]] = []
    for v in variants:
        objs = []
        for src in sources:
            flags = _unit_flags(v, src.name)
            digest = _hash(key, src.name, flags, tc.cxx_id, tc.torch_version, tc.openmp)
            obj = objects / f"{src.stem}-{digest}.o"
            units.setdefault(obj, tc.compile_cmd(src, flags))
            objs.append(obj)
        plan.append((v, objs))
    todo = {obj: cmd for obj, cmd in units.items() if not obj.exists()}
    if todo:
        names = ", ".join(v.name for v in variants)
        say(f"declattn: compiling the native extension ({names}: {len(todo)} compiles) "
            f"into {out}")
    workers = jobs or int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_run, cmd, obj, Path(cmd[cmd.index("-c") + 1]).name)
                   for obj, cmd in todo.items()]
        try:
            for f in futures:
                f.result()
        except KernelBuildError:
            pool.shutdown(cancel_futures=True)  # the first failure is the one reported
            raise
    libs = {}
    for v, objs in plan:
        lib = out / f"declattn_{v.name}.so"
        _run(tc.link_cmd(objs, rpath), lib, f"the {v.name} library")
        libs[v.name] = lib.name
    manifest = Manifest(key, tc.torch_version, tc.cxx_id, tc.openmp, libs)
    manifest.save(out)
    return manifest
