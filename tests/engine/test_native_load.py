"""Which build of the native extension a process loads (``engine/native/load.py`` and
``variants.py``): the best variant this CPU runs, by its flags, and what the library says
it was compiled for; a variant asked for by name; one warning, naming cause and fix, where
none can be had. A process loads one library, so the cases that load another run in a
child process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from declattn.engine import native
from declattn.engine.native import load
from declattn.engine.native.variants import X86_VARIANTS, best, by_name, cpu_flags, shipped

V3, VNNI, BF16, AMX = X86_VARIANTS


def test_the_best_variant_is_the_last_the_cpu_runs() -> None:
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
    zen4 = avx2_only | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                        "avx512_vnni", "avx512_bf16"}
    spr = zen4 | {"amx_tile", "amx_bf16"}
    skylake_x = zen4 - {"avx512_vnni", "avx512_bf16"}
    assert best(X86_VARIANTS, avx2_only) is V3 and best(X86_VARIANTS, skylake_x) is V3
    assert best(X86_VARIANTS, zen4) is BF16 and best(X86_VARIANTS, spr) is AMX
    assert best(X86_VARIANTS, zen4 - {"avx512_bf16"}) is VNNI
    assert best(X86_VARIANTS, frozenset({"sse2"})) is None
    assert best((V3, BF16), spr) is BF16  # of those built
    with pytest.raises(ValueError, match="no native variant 'avx9'"):
        by_name("avx9")


def test_this_process_loaded_the_best_variant_for_this_cpu() -> None:
    lib = native.library()
    assert lib is not None, "a machine with a compiler must have the extension"
    if os.environ.get(load.ENV_CHOICE, "auto") == "auto":
        want = best(shipped(), cpu_flags())
        assert want is not None and lib.variant == want.name
    assert set(lib.isa) - {"openmp"} <= cpu_flags()  # never code this CPU cannot run
    assert lib.origin in ("package", "jit") and lib.path.exists() and lib.why


def test_a_variant_this_cpu_lacks_is_an_error(monkeypatch) -> None:
    missing = next((v for v in reversed(X86_VARIANTS) if not v.runs_on(cpu_flags())), None)
    if missing is None or not cpu_flags():
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv(load.ENV_CHOICE, missing.name)
    with pytest.raises(ValueError, match=f"DECLATTN_NATIVE={missing.name}: this CPU lacks"):
        load._load()


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=900)


@pytest.mark.slow
def test_a_lower_variant_asked_for_loads_and_agrees() -> None:
    """``DECLATTN_NATIVE=avx2`` on a CPU with more: the AVX2 build loads (from the package,
    or built) and decode attention agrees with this process's to rounding."""
    if not V3.runs_on(cpu_flags()) or native.library().variant == "avx2":
        pytest.skip("no variant below this CPU's best to ask for")
    code = """
import json, torch
from declattn.engine import native
lib = native.library()
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 8, 64, generator=g).bfloat16()
kp = torch.randn(2, 512, 64, generator=g).bfloat16()
out = native.decode_op()(q, kp, kp, torch.tensor([[0, 300]]), torch.tensor([0, 1]), 0.125, 64)
print(json.dumps([lib.variant, list(lib.isa), out.float().flatten().tolist()]))
"""
    low = _child(code, DECLATTN_NATIVE="avx2")
    here = _child(code)
    assert low.returncode == 0 and here.returncode == 0, low.stderr[-2000:] + here.stderr[-2000:]
    (lv, lisa, lout), (hv, _, hout) = (json.loads(p.stdout.splitlines()[-1]) for p in (low, here))
    assert lv == "avx2" and "avx512f" not in lisa and hv == native.library().variant
    assert max(abs(a - b) for a, b in zip(lout, hout, strict=True)) < 2e-2  # bf16 rounding


def test_no_compiler_and_no_build_is_one_warning_with_its_fix(tmp_path) -> None:
    """Nothing built in the package (``DECLATTN_NATIVE=jit``) and no compiler: every
    caller gets ``None`` after one warning that names the cause and the fix."""
    code = """
import warnings
warnings.simplefilter("{mode}")
from declattn.engine import native
from declattn.engine.quant import kernel
from declattn.engine.models import fused
assert native.decode_op() is None and native.store_op() is None
assert kernel.gguf_ops() is None and fused.layer_ops() is None
"""
    no_compiler = {"DECLATTN_NATIVE": "jit", "CXX": "", "PATH": str(tmp_path),
                   "XDG_CACHE_HOME": str(tmp_path)}
    done = _child(code.format(mode="always") + "assert native.library() is None\n",
                  **no_compiler)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [ln for ln in done.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, done.stderr
    assert "no C++ compiler found" in warned[0] and "Fix: install g++" in warned[0]
    switched = _child(code.format(mode="error"), **no_compiler, DECLATTN_DECODE_KERNEL="torch",
                      DECLATTN_GGUF_KERNEL="torch", DECLATTN_LAYER_KERNEL="torch")
    assert switched.returncode == 0, switched.stderr[-3000:]  # chosen: no warning at all


def test_a_build_without_openmp_warns_once_with_its_fix(monkeypatch) -> None:
    """A library whose build has no OpenMP loads, with one warning per process: its
    kernels run on one thread."""
    lib = native.library()
    assert lib is not None
    for origin, fix in (("jit", f"delete {lib.path.parent}"), ("package", "reinstall declattn")):
        serial = dataclasses.replace(lib, origin=origin,
                                     isa=tuple(i for i in lib.isa if i != "openmp"))
        monkeypatch.setattr(load, "_load", lambda serial=serial: serial)
        load.library.cache_clear()
        try:
            with pytest.warns(RuntimeWarning, match="one thread") as caught:
                assert native.library() is serial and native.library() is serial
            assert len(caught) == 1 and fix in str(caught[0].message)
        finally:
            monkeypatch.undo()
            load.library.cache_clear()
    assert native.library() == lib  # the real one again (already loaded: no second build)
