"""llama.cpp's own batched-decode benchmark, ``llama-batched-bench``, on the same GGUF:
the peer figure for ``declattn bench throughput``'s in-process rows.

Why this tool and not ``llama-server`` for the decode ratio: through a server, N requests
over long documents spend minutes prefilling one after another, and a reply of a few
hundred tokens is over before the last prompt is in, so no window has all N decoding at
once on a small CPU. ``llama-batched-bench`` prefills N distinct prompts of ``context``
tokens (random ids), then times ``steps`` decode steps of all N sequences together: its
``S_TG`` is the aggregate decode tokens/s the in-process rows measure for declattn
(weights read once a step for the batch, each sequence reading its own KV). Built by
``make bench-env`` from the llama.cpp source ``llama-cpp-python`` vendors; never part of
``make test``.

``shared_prompt`` (``-pps``) prefills one prompt and gives it to every sequence (llama.cpp
shares its KV cells; each sequence still attends over all of them, so a decode step reads
what N distinct prompts would, from one copy): one prefill instead of N, which makes
N = 16 or 32K measurable on two cores. Its rows are labelled so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BINARY = ".venv-bench/bin/llama-batched-bench"


@dataclass(frozen=True)
class BatchedConfig:
    """``steps``: decode steps timed per sequence; ``flash_attn``: the settings to run;
    ``shared_prompt``: one prompt prefilled for all sequences (above)."""

    contexts: tuple[int, ...] = (8192, 16384)
    concurrency: tuple[int, ...] = (1, 8)
    steps: int = 32
    threads: int = 2
    flash_attn: tuple[str, ...] = ("on", "off")
    binary: str = BINARY
    shared_prompt: bool = False

    def __post_init__(self) -> None:
        if not set(self.flash_attn) <= {"on", "off"}:
            raise ValueError(f"flash_attn: 'on' and/or 'off', not {self.flash_attn}")
        if self.steps < 1 or self.threads < 1:
            raise ValueError("steps and threads must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def command(cfg: BatchedConfig, gguf: Path, context: int, n: int, fa: str) -> list[str]:
    """One run: ``n`` sequences of ``context`` prompt tokens, then ``cfg.steps`` steps."""
    return [cfg.binary, "-m", str(gguf), "-c", str(n * (context + cfg.steps)),
            "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(cfg.steps),
            "-npl", str(n), "-t", str(cfg.threads), "-tb", str(cfg.threads), "-fa", fa,
            "--output-format", "jsonl", *(["-pps"] if cfg.shared_prompt else [])]


def parse(stdout: str) -> dict[str, Any]:
    """The one JSONL row a run prints (the tool skips a size its context cannot hold:
    then there is none, an error)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise RuntimeError(f"llama-batched-bench printed {len(rows)} result rows, not 1")
    return rows[0]


def run_batched(cfg: BatchedConfig, gguf: Path,
                log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every context x concurrency x flash-attention setting of ``cfg``: decode tokens/s
    of all sequences together, and the prefill that came before."""
    if not Path(cfg.binary).is_file():
        raise FileNotFoundError(f"{cfg.binary}: no llama-batched-bench; build it with "
                                "`make bench-env`")
    say = log or (lambda _m: None)
    results = []
    for context in cfg.contexts:
        for n in cfg.concurrency:
            for fa in cfg.flash_attn:
                done = subprocess.run(command(cfg, gguf, context, n, fa), capture_output=True,
                                      text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"llama-batched-bench failed: {done.stderr[-2000:]}")
                row = parse(done.stdout)
                arm = f"llama fa={fa}" + (" shared prompt" if cfg.shared_prompt else "")
                out = {"context": context, "n": n, "arm": arm,
                       "decode_tokens_per_second": row["speed_tg"],
                       "step_ms": 1e3 * row["t_tg"] / cfg.steps,
                       "prefill_tokens_per_second": row["speed_pp"],
                       "prefill_seconds": row["t_pp"], "raw": row}
                say(f"{arm} x{n} at {context:,}: {row['speed_tg']:.1f} tok/s decode, "
                    f"prefill {row['t_pp']:.0f} s")
                results.append(out)
    return results
