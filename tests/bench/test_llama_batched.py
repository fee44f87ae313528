"""``bench throughput --parts llama-batched``: the command it gives llama.cpp's
``llama-batched-bench`` and what it reads back (the tool itself lives in .venv-bench, never
in ``make test``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from declattn.bench.llama_batched import BatchedConfig, command, parse, run_batched

# One row as llama-batched-bench 0.3.36's ``--output-format jsonl`` prints it.
ROW = ('{"n_kv_max": 65792, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, '
       '"is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, '
       '"pp": 8192, "tg": 32, "pl": 8, "n_kv": 65792, "t_pp": 270.5, "speed_pp": 242.3, '
       '"t_tg": 3.2, "speed_tg": 80.0, "t": 273.7, "speed": 240.4}')


def test_the_command_holds_every_sequence_and_asks_for_jsonl() -> None:
    cfg = BatchedConfig(steps=32, threads=2)
    cmd = command(cfg, Path("m.gguf"), 8192, 8, "on")
    arg = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert int(arg["-c"]) == 8 * (8192 + 32)  # the tool skips, silently, a size it cannot hold
    assert (arg["-npp"], arg["-ntg"], arg["-npl"], arg["-fa"]) == ("8192", "32", "8", "on")
    assert arg["--output-format"] == "jsonl" and arg["-t"] == arg["-tb"] == "2"
    assert "-pps" not in cmd
    assert command(BatchedConfig(shared_prompt=True), Path("m.gguf"), 8192, 8, "on")[-1] == "-pps"


def test_the_one_result_row_is_read_and_a_missing_one_is_an_error() -> None:
    row = parse(f"main: n_kv_max = 65792\n{ROW}\n\nllama_perf_context_print: ...\n")
    assert (row["pl"], row["speed_tg"], row["t_pp"]) == (8, 80.0, 270.5)
    with pytest.raises(RuntimeError, match="0 result rows"):
        parse("main: n_kv_max = 1024\n")


def test_settings_are_checked_and_a_missing_tool_names_the_make_target() -> None:
    with pytest.raises(ValueError, match="flash_attn"):
        BatchedConfig(flash_attn=("auto",))
    with pytest.raises(FileNotFoundError, match="make bench-env"):
        run_batched(BatchedConfig(binary="/nonexistent/llama-batched-bench"), Path("m.gguf"))
