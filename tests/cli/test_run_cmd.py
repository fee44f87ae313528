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


def test_a_second_process_reads_the_documents_kv_from_disk(tmp_path: Path) -> None:
    """Two ``declattn run`` processes over one document: the second reads the document's
    K/V from the prefix cache's disk tier, says so, and answers the same."""
    import json
    import os
    import subprocess
    import sys

    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(
        f"Entry {i}: the keeper walked the shore at dawn and counted {i} boats." for i in range(120)
    ))
    code = "import sys; from declattn.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "run", "--model", "smollm2-135m", "--context", str(doc),
            "--question", "How many boats in entry 7?", "--max-tokens", "8", "--vanilla",
            "--json", "--kv-cache-dir", str(tmp_path / "kv")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    runs = []
    for _ in range(2):
        out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout)["vanilla"])
    first, second = (r["stats"] for r in runs)
    assert first["disk_tokens"] == first["cached_tokens"] == 0
    assert second["disk_tokens"] == second["cached_tokens"] > 0
    assert second["disk_tokens"] % 512 == 0  # whole prefill chunks
    assert runs[0]["text"] == runs[1]["text"]
