"""``declattn run``: a DA request that runs vanilla says so on the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest

from declattn.cli import main


def test_a_context_under_min_context_says_it_ran_vanilla(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper was named Ada. She kept two goats on the island.")
    args = ["run", "--model", "smollm2-135m", "--context", str(doc), "--question",
            "Who was the keeper?", "--max-tokens", "4"]
    assert main([*args, "--min-context", "100000"]) == 0
    assert "note: ran vanilla" in capsys.readouterr().out
    assert main([*args, "--min-context", "0"]) == 0
    out = capsys.readouterr().out
    assert "note: ran vanilla" not in out
    assert "decode route: stack: 30 layers of GGUF blocks" in out  # one line, after loading


def test_a_negative_min_context_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    assert main(["run", "--model", "smollm2-135m", "--context", str(doc), "--question", "q",
                 "--min-context", "-1"]) == 2
    assert "--min-context must be >= 0" in capsys.readouterr().err
