"""The layers of docs/architecture.md, enforced: what may import what.

Bottom up, a package may import its own modules and those of the layers below it, never
one above it, nor a peer on its own layer:

    protocol  <  da  <  engine  <  api  <  corpora  <  show, train, server, eval  <  vllm  <
    bench  <  cli

- ``protocol/`` and ``da/`` import no torch: the protocol and the DA core are usable by
  any engine;
- above the engine, only the facade (``declattn.api.facade``) imports the engine loop
  (``declattn.engine.engine``): everything else reaches the engine through
  ``declattn.Engine``;
- no module imports another module's private (``_``-prefixed) names;
- no two modules import each other (lazy and ``TYPE_CHECKING`` imports count too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import declattn

PACKAGE = Path(declattn.__file__).parent
LAYERS: list[set[str]] = [
    {"protocol"},
    {"da"},
    {"engine"},
    {"api"},
    {"corpora"},
    {"show", "train", "server", "eval"},
    {"vllm"},
    {"bench"},
    {"cli"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import, at any depth (lazy imports count too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _package(module: str) -> str | None:
    """The top-level package of a ``declattn`` module (None for ``declattn`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "declattn" else None


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(RANK), "a new package needs its place in LAYERS (and the docs)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"top-level modules belong in a package: {loose}"


def test_no_import_points_up_or_sideways() -> None:
    offenders = []
    for name, tree in _modules():
        mine = _package(name)
        if mine is None:
            continue
        for module, _ in _imports(tree):
            theirs = _package(module)
            if theirs is None or theirs == mine:
                continue
            if RANK[theirs] >= RANK[mine]:
                offenders.append(f"{name} -> {module}")
    assert offenders == []


def test_the_protocol_and_the_da_core_import_no_torch() -> None:
    light = sorted(n for n, _ in _modules() if _package(n) in ("protocol", "da"))
    code = f"import sys; import {', '.join(light)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", light


def test_only_the_facade_imports_the_engine_loop() -> None:
    offenders = [
        name
        for name, tree in _modules()
        if _package(name) != "engine" and name != "declattn.api.facade"
        for module, _ in _imports(tree)
        if module == "declattn.engine.engine"
    ]
    assert offenders == []


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = [
        f"{name}: from {module} import {n}"
        for name, tree in _modules()
        for module, names in _imports(tree)
        if module.startswith("declattn") and module != name
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert offenders == []


def test_no_two_modules_import_each_other() -> None:
    known = {name for name, _ in _modules()}
    edges = {
        (name, module)
        for name, tree in _modules()
        for module, names in _imports(tree)
        for target in [module, *(f"{module}.{n}" for n in names)]
        if target in known and target != name
        for module in [target]
    }
    mutual = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert mutual == []
