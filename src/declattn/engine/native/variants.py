"""The CPU variants the native extension is built in, and which one this CPU runs.

Why variants: the kernels have AVX2, AVX-512 VNNI, AVX-512 BF16 and AMX code paths, chosen
by the compiler's target, and a package installed on one machine runs on another. As
llama.cpp's ``GGML_CPU_ALL_VARIANTS`` does, the same sources are built once per level of
instruction set (``build.py``) and the loader takes the best level the CPU has, by its
feature flags, and says which (``load.py``). A CPU below every level (x86 without AVX2, a
CPU whose flags cannot be read) builds its own at first use (``Variant.native``).

Standard library only: ``setup.py`` imports this file to build the variants.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
"""The sources of the extension (``*.cpp``, each a translation unit, and their headers)."""


@dataclass(frozen=True)
class Variant:
    """One build of the extension: its compiler target and the CPU flags it needs.

    ``shares``: a variant whose objects this one links, for every source but ``own`` (and
    ``library.cpp``, which names the variant): AMX code lives only in the decode attention,
    so elsewhere the AMX build is the BF16 build, compiled once."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]
    shares: str | None = None
    own: tuple[str, ...] = ()

    def runs_on(self, cpu: frozenset[str]) -> bool:
        return self.needs <= cpu


_V3 = ("-march=x86-64-v3",)
_V3_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = ("-march=x86-64-v4", "-mavx512vnni")
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                         "avx512_vnni"}
_BF16 = (*_V4, "-mavx512bf16")

X86_VARIANTS = (
    Variant("avx2", _V3, _V3_FLAGS),
    Variant("avx512_vnni", _V4, _V4_FLAGS),
    Variant("avx512_bf16", _BF16, _V4_FLAGS | {"avx512_bf16"}),
    Variant("amx", (*_BF16, "-mamx-tile", "-mamx-bf16"),
            _V4_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"},
            shares="avx512_bf16", own=("decode_attn.cpp",)),
)
"""Best last. AVX-512 without VNNI (Skylake-X) runs the AVX2 build: every AVX-512 path of
the kernels needs VNNI or BF16 too."""

GENERIC = Variant("generic", (), frozenset())
"""Another architecture's build at its compiler's default target (aarch64: NEON)."""


def native_variant(cpu: frozenset[str]) -> Variant:
    """A build for this very CPU (``-march=native``), for a CPU no shipped variant fits;
    its name carries the CPU's flags, so the cache keeps one per CPU."""
    return Variant("native", ("-march=native",), cpu)


def shipped() -> tuple[Variant, ...]:
    """The variants a package built on this machine's architecture ships."""
    machine = platform.machine().lower()
    return X86_VARIANTS if machine in ("x86_64", "amd64") else (GENERIC,)


def by_name(name: str) -> Variant:
    for v in (*X86_VARIANTS, GENERIC):
        if v.name == name:
            return v
    names = ", ".join(v.name for v in (*X86_VARIANTS, GENERIC))
    raise ValueError(f"no native variant {name!r} (one of {names})")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (``/proc/cpuinfo``: only what the
    kernel also enables, e.g. AVX-512 state saved on context switches); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def best(available: tuple[Variant, ...], cpu: frozenset[str]) -> Variant | None:
    """The last (best) of ``available`` this CPU runs; ``None`` where it runs none.
    ``generic`` runs on any CPU of its architecture."""
    fit = [v for v in available if v.runs_on(cpu)]
    return fit[-1] if fit else None
