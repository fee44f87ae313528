"""Builds the native extension when the package is built or installed (the rest of the
metadata is pyproject.toml's).

Every CPU variant this architecture ships (``src/declattn/engine/native/variants.py``) is
compiled from ``src/declattn/engine/csrc`` by ``native/build.py`` into the package's
``declattn/engine/native/lib/``: into the wheel, or in place for ``pip install -e .``. At
import the loader takes the best variant the CPU runs. Objects are kept under
``build/native-objects`` by a key of everything they depend on, so a rebuild of unchanged
sources (another install, ``pip wheel .`` after ``pip install -e .``) only links.

``DECLATTN_NATIVE_VARIANTS``: a comma-separated subset of the variants to build, or
``none`` to build nothing (the loader then compiles the variant this CPU runs at first
use). ``MAX_JOBS``: compiles at a time (default: the CPU count).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "src" / "declattn" / "engine" / "native"


def _native(module: str) -> types.ModuleType:
    """``native/<module>.py`` from a package of its own: no ``declattn`` import (its
    dependencies need not be installed to build it)."""
    if "_declattn_native" not in sys.modules:
        pkg = types.ModuleType("_declattn_native")
        pkg.__path__ = [str(NATIVE)]
        sys.modules["_declattn_native"] = pkg
    return importlib.import_module(f"_declattn_native.{module}")


class BuildNative(build_ext):
    """Compiles the extension's variants (setuptools' own extension machinery builds one
    Python module per source set; these are torch op libraries, one per CPU variant)."""

    def run(self) -> None:
        self._outputs: list[str] = []
        b, v = _native("build"), _native("variants")
        chosen = os.environ.get("DECLATTN_NATIVE_VARIANTS", "").strip()
        variants = v.shipped()
        if chosen == "none":
            return
        if chosen:
            variants = tuple(v.by_name(n.strip()) for n in chosen.split(","))
        inplace = self.inplace or getattr(self, "editable_mode", False)
        out = NATIVE / "lib" if inplace else Path(self.build_lib) / "declattn/engine/native/lib"
        manifest = b.build(variants, out, objects=ROOT / "build" / "native-objects",
                           say=lambda m: print(m, flush=True))
        if not inplace:
            self._outputs = [str(out / f) for f in (*manifest.variants.values(), b.MANIFEST)]

    def get_outputs(self) -> list[str]:
        return list(getattr(self, "_outputs", []))

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BinaryDistribution(Distribution):
    """A wheel with compiled libraries is tagged for its platform, not ``py3-none-any``."""

    def has_ext_modules(self) -> bool:
        return True


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildNative})
