"""``declattn chat``: questions from standard input, one turn each, over one document."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from declattn.cli import main


def _chat(monkeypatch: pytest.MonkeyPatch, lines: str, *args: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return main(["chat", *args, "--max-tokens", "4", "--threads", "1", "--no-kv-disk"])


def test_each_line_is_a_turn_and_later_turns_reuse_the_document(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path, long_doc: Path,
) -> None:
    lines = "Who kept the light?\nAnd the boats?\n/new\nOnce more?\n\nnever asked\n"
    assert _chat(monkeypatch, lines, "--model", str(tiny_model_dir), "--context",
                 str(long_doc), "--min-context", "0") == 0
    out = capsys.readouterr().out
    # three turns, numbered on; the empty line ends the conversation
    assert [int(n) for n in re.findall(r"answer (\d+):", out)] == [1, 2, 3]
    assert "a new conversation over the same document" in out
    prompts = [line for line in out.splitlines() if line.startswith("prompt ")]
    assert len(prompts) == 3
    assert "(KV:" not in prompts[0]  # the first turn prefills the document
    assert all("(KV:" in p for p in prompts[1:])  # later turns take it from the cache


def test_vanilla_and_no_mask_exclude_each_other(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], long_doc: Path,
) -> None:
    with pytest.raises(SystemExit) as exc:
        _chat(monkeypatch, "", "--model", "x", "--context", str(long_doc), "--vanilla",
              "--no-mask")
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context", "-"], "--context must be a file"),
        (["--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], long_doc: Path,
    extra: list[str], message: str,
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    args = ["chat", "--model", "x", "--context", str(long_doc), *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err
