"""How the native extension is compiled (``engine/native/build.py``): objects kept by a key
of everything they depend on, shared between variants where the code is the same, built
without OpenMP where the compiler has none, and a failure reported in one line with its
log. Tiny sources stand in for the kernels, so each build takes a few seconds."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from declattn.engine.native import build
from declattn.engine.native.variants import X86_VARIANTS, Variant, by_name, native_variant

PLAIN = "int twice(int x) { return 2 * x; }\n"
TINY_OP = """#include <torch/library.h>
int64_t twice(int64_t x) { return 2 * x; }
TORCH_LIBRARY(declattn_test_build, m) { m.def("twice(int x) -> int", twice); }
"""


def fake_compiler(tmp_path: Path, *, no_openmp: bool = False, fails: bool = False) -> str:
    """A ``CXX`` that logs each call's source (or ``link``) and OpenMP-ness to ``calls``;
    it rejects ``-fopenmp`` as clang without libomp does, or fails everything."""
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler")
    script = tmp_path / "cxx"
    script.write_text(
        "#!/bin/sh\n"
        "omp=plain; what=link\n"
        'for a in "$@"; do case "$a" in -fopenmp) omp=openmp;; *.cpp) what=$(basename "$a");; '
        "esac; done\n"
        f'echo "$what $omp" >> "{tmp_path}/calls"\n'
        f"if {str(fails).lower()} || {{ [ $omp = openmp ] && {str(no_openmp).lower()}; }}; then\n"
        "  echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1\n"
        "fi\n"
        f'exec "{real}" "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def compiles(tmp_path: Path) -> list[str]:
    """The kernel sources compiled so far, with OpenMP-ness (not the OpenMP probe)."""
    return [c for c in calls(tmp_path) if c.split()[0].endswith(".cpp")
            and not c.startswith("omp.cpp")]


def sources(tmp_path: Path, **files: str) -> Path:
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name, text in files.items():
        (csrc / name).write_text(text)
    return csrc


GENERIC = Variant("plain", (), frozenset())


def test_a_build_loads_and_a_second_build_only_links(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", fake_compiler(tmp_path))
    csrc = sources(tmp_path, **{"op.cpp": TINY_OP})
    manifest = build.build((GENERIC,), tmp_path / "out", csrc=csrc, rpath=True)
    lib = tmp_path / "out" / manifest.variants["plain"]
    assert manifest.sources == build.sources_key(csrc) and manifest.torch == torch.__version__
    assert manifest.openmp and lib.stat().st_mode & 0o444 == 0o444  # readable by all
    torch.ops.load_library(str(lib))
    assert torch.ops.declattn_test_build.twice(21) == 42
    assert compiles(tmp_path) == ["op.cpp openmp"]
    build.build((GENERIC,), tmp_path / "out", csrc=csrc, rpath=True)
    assert compiles(tmp_path) == ["op.cpp openmp"]  # the object was kept: only a link
    assert build.Manifest.read(tmp_path / "out") == manifest


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="not x86")
def test_the_amx_variant_compiles_only_its_own_sources(tmp_path, monkeypatch) -> None:
    """AMX code is only in the decode attention: elsewhere the AMX build links the BF16
    build's objects; ``library.cpp`` names each variant, so it is compiled per variant."""
    monkeypatch.setenv("CXX", fake_compiler(tmp_path))
    csrc = sources(tmp_path, **{"decode_attn.cpp": PLAIN, "other.cpp": PLAIN.replace(
        "twice", "thrice"), "library.cpp": "int variant = 1;\n"})
    bf16, amx = by_name("avx512_bf16"), by_name("amx")
    build.build((bf16, amx), tmp_path / "out", csrc=csrc)
    compiled = sorted(c.split()[0] for c in compiles(tmp_path))
    assert compiled == ["decode_attn.cpp", "decode_attn.cpp", "library.cpp", "library.cpp",
                        "other.cpp"]


def test_a_compiler_without_openmp_builds_without_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, no_openmp=True))
    csrc = sources(tmp_path, **{"a.cpp": PLAIN})
    manifest = build.build((GENERIC,), tmp_path / "out", csrc=csrc)
    assert not manifest.openmp
    assert compiles(tmp_path) == ["a.cpp plain"]
    assert all(c.endswith("plain") for c in calls(tmp_path) if not c.startswith("omp.cpp"))


def test_a_failed_compile_is_one_line_with_its_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, fails=True))
    csrc = sources(tmp_path, **{"a.cpp": PLAIN, "b.cpp": PLAIN})
    with pytest.raises(build.KernelBuildError, match="unsupported option") as raised:
        build.build((GENERIC,), tmp_path / "out", csrc=csrc)
    message = str(raised.value)
    assert "\n" not in message and "log: " in message
    assert Path(message.split("log: ")[1]).read_text().count("unsupported option") == 1


def test_no_compiler_is_named(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler found"):
        build.compiler()


def test_the_key_follows_sources_flags_compiler_torch_and_openmp(tmp_path) -> None:
    csrc = sources(tmp_path, **{"a.cpp": '#include "a.h"\n', "a.h": "int a = 1;\n"})
    v3, v4 = X86_VARIANTS[:2]
    key = build.build_key(v3, "c++ 12", "2.13.0", True, csrc)
    assert key == build.build_key(v3, "c++ 12", "2.13.0", True, csrc)
    others = {build.build_key(v4, "c++ 12", "2.13.0", True, csrc),
              build.build_key(v3, "c++ 13", "2.13.0", True, csrc),
              build.build_key(v3, "c++ 12", "2.14.0", True, csrc),
              build.build_key(v3, "c++ 12", "2.13.0", False, csrc),
              build.build_key(native_variant(frozenset({"sse2"})), "c++ 12", "2.13.0", True,
                              csrc)}
    assert key not in others and len(others) == 5
    (csrc / "a.h").write_text("int a = 2;\n")  # a header changed
    assert build.build_key(v3, "c++ 12", "2.13.0", True, csrc) != key
