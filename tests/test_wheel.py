"""The wheel a user installs: built from this checkout, installed into a fresh virtual
environment, it loads every native op from the package's own build (no compile at first
use) and decodes as this environment does, bit for bit.

The wheel is built as a user builds one (``pip wheel .``) but without build isolation
(the build then takes the torch already installed here instead of installing a second
copy, the same version the isolated build pins). The fresh environment gets only the
wheel; its dependencies (torch, transformers, ...) are read from this environment's
site-packages through a ``.pth`` line, which adds their folder to the path and nothing
else: ``declattn`` is imported from the installed wheel, which the probe checks.

A rebuild of unchanged sources reuses the objects an earlier build compiled
(``build/native-objects``, keyed by sources, flags, compiler and torch), so after
``make test``'s own install this test only links, packs and installs.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from declattn.engine.native.variants import CSRC, shipped

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

PROBE = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[2])  # tests/engine: the tiny GGUF model the decode tests use
import declattn
from declattn.engine import native
from declattn.engine.engine import PagedEngine
from declattn.engine.controller import Controller
from declattn.engine.sampler import SamplingParams
from test_quant_decode_layers import gguf_model, ids
from tiny_world import Tok

lib = native.library()
model = gguf_model("qwen2", torch.bfloat16)

class Narrow(Controller):
    def view(self, length):
        return sorted({1, (length - 1) // 16})

engine = PagedEngine(model, Tok(), num_blocks=32, block_size=16, prefill_chunk=64)
logits = []
seq = engine.add(Narrow(ids(70, 3)), SamplingParams(max_tokens=5, ignore_eos=True))
_process = seq.controller.process_logits
seq.controller.process_logits = lambda x: logits.append(x.clone()) or _process(x)
while engine.has_work:
    engine.step()
torch.save({"logits": logits, "pools": engine.cache.k + engine.cache.v}, sys.argv[1])
print(json.dumps({
    "declattn": declattn.__file__,
    "library": None if lib is None else [lib.variant, lib.origin, str(lib.path)],
    "ops": sorted(n for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("declattn::")),
    "route": [model.decode_route.kind, dict(model.decode_route.missed)],
    "tokens": seq.output_ids,
}))
"""


def _env(**extra: str) -> dict[str, str]:
    """This environment less anything that would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DECLATTN_NATIVE")}
    return {**env, **extra}


def _probe(python: str, out: Path, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [python, "-c", PROBE, str(out), str(ROOT / "tests" / "engine")],
        capture_output=True, text=True, env=env, cwd=out.parent, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, env=_env(), timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("declattn-*.whl")
    return built


def test_the_wheel_holds_every_variant_and_every_source(wheel: Path) -> None:
    """Each variant this architecture ships, the manifest, and every C++ source and header
    (the loader builds from them where no variant fits): a header left out once made a
    wheel's first-use build fail."""
    names = set(zipfile.ZipFile(wheel).namelist())
    lib = "declattn/engine/native/lib/"
    assert {f"{lib}declattn_{v.name}.so" for v in shipped()} | {f"{lib}manifest.json"} <= names
    sources = {p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert {f"declattn/engine/csrc/{s}" for s in sources} <= names
    assert "none-any" not in wheel.name  # a platform wheel: it holds compiled code


def test_the_installed_wheel_loads_its_own_build_and_decodes_alike(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    deps = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib.stdout.strip(), "_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, env=_env(), timeout=600,
    )
    cache = tmp_path / "cache"  # a first-use build would land here
    installed = _probe(python, tmp_path / "installed.pt", _env(XDG_CACHE_HOME=str(cache)))
    here = _probe(sys.executable, tmp_path / "here.pt", {**os.environ})

    site_dir = Path(purelib.stdout.strip()).resolve()
    assert Path(installed["declattn"]).resolve().is_relative_to(site_dir)
    variant, origin, path = installed["library"]
    assert origin == "package" and Path(path).resolve().is_relative_to(site_dir)
    assert not (cache / "declattn" / "kernels").exists()  # nothing compiled
    assert variant == here["library"][0]
    assert installed["ops"] == here["ops"] and len(installed["ops"]) >= 10
    assert installed["route"] == here["route"] == ["stack", {}]
    assert installed["tokens"] == here["tokens"]
    got, want = torch.load(tmp_path / "installed.pt"), torch.load(tmp_path / "here.pt")
    assert len(got["logits"]) == 5
    for a, b in zip(got["logits"] + got["pools"], want["logits"] + want["pools"], strict=True):
        assert torch.equal(a, b)


def test_a_wheel_missing_a_header_says_so(wheel: Path, tmp_path: Path) -> None:
    """The failure the issue found, made on purpose: the built variants gone and a header
    missing, the first-use build fails, and the one warning names the missing header and
    the fix (not "install a compiler")."""
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    for f in (unpacked / "declattn/engine/native/lib").iterdir():
        f.unlink()
    (unpacked / "declattn/engine/csrc/decode_attn_portable.h").unlink()
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from declattn.engine import native\n"
            "assert native.library() is None and native.decode_op() is None\n")
    env = _env(PYTHONPATH=str(unpacked), XDG_CACHE_HOME=str(tmp_path), MAX_JOBS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)  # one compile at a time: the first one fails
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [ln for ln in done.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, done.stderr
    assert "decode_attn_portable.h" in warned[0] and "reinstall declattn" in warned[0]
    assert "install g++" not in warned[0]


def test_the_build_environment_pins_the_torch_it_runs_with() -> None:
    """pyproject's build requirements take the torch the package runs with (a looser pin
    lets pip put another torch build in the isolated build environment)."""
    text = (ROOT / "pyproject.toml").read_text()
    build = text[text.index("[build-system]"):text.index("build-backend")]
    assert '"torch==2.13.0"' in build and torch.__version__.startswith("2.13.0")
