"""The layers of DESIGN.md, enforced: what may import what.

- ``protocol/``, ``scope.py``, ``accounting.py`` and ``replay.py`` import no torch: the
  protocol is usable by any engine;
- above the engine, only the facade (``api.py``) imports the engine loop
  (``declattn.engine.engine``): everything else reaches the engine through
  ``declattn.Engine``;
- no module imports another module's private (``_``-prefixed) names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import declattn

PACKAGE = Path(declattn.__file__).parent
TORCH_FREE = ["declattn.scope", "declattn.accounting", "declattn.replay"]


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


def test_the_protocol_imports_no_torch() -> None:
    protocol = sorted(
        n for n, _ in _modules() if n.startswith("declattn.protocol") or n in TORCH_FREE
    )
    code = f"import sys; import {', '.join(protocol)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", protocol


def test_only_the_facade_imports_the_engine_loop() -> None:
    offenders = [
        name
        for name, tree in _modules()
        if not name.startswith("declattn.engine") and name != "declattn.api"
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
