"""``declattn bench reuse --across-processes``: a document prefilled once, for every process.

Two processes over one document (``reuse.questions_document``) and one fresh, empty
cache directory, so the first one is truly cold:

1. the cold process asks question 1 (the whole prefill; its whole chunks go to disk),
   then question 2 (the in-process second question: the document from memory);
2. a new process asks question 1 again: the document's K/V comes from the disk tier.

Reported: each question's time to first token (the request's prefill, disk reads
included, the first token included), the new process's against the cold one and against
the in-process second question (the goals: at most 3% of cold, within 1.5x of the
in-process one), each process's start-up (model load, KV pool, disk-tier key), and the
disk's bytes per cached token beside the K/V's own. The directory is removed at the end:
a benchmark's documents have no business in the user's cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from declattn.bench.reuse import ReuseConfig, questions_document

GOAL_OVER_COLD = 0.03
GOAL_OVER_IN_PROCESS = 1.5


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's part: load, make the engine (pool and disk tier), ask ``spec["ask"]``."""
    from declattn.api import Engine
    from declattn.bench.reuse import ask_document
    from declattn.engine.threads import use_threads

    use_threads(spec["threads"])
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(spec["model"], kv_cache_dir=spec["kv_cache_dir"])
    kv_dtype = engine.kv_dtype  # builds the engine: its pool, and its disk tier's key
    startup = time.perf_counter() - t0
    cfg = ReuseConfig(tokens=spec["tokens"], questions=2, seed=spec["seed"])
    text, qa = questions_document(engine, cfg)
    doc = engine.open(text)
    rows = [asdict(ask_document(doc, *qa[i], spec["max_tokens"])) for i in spec["ask"]]
    layers = engine.loaded.config.num_layers
    return {"startup_seconds": startup, "rows": rows, "kv_dtype": kv_dtype,
            "kv_bytes_per_token": engine.pool.bytes_per_token * layers}


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    code = ("import json, sys; from declattn.bench.reuse_processes import child; "
            "print(json.dumps(child(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"a benchmark process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_across_processes(
    model: str, cfg: ReuseConfig, threads: int, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The cold process, then the new one, over one fresh cache directory."""
    from declattn.engine.kvdisk.store import scan

    say = log or (lambda _m: None)
    with tempfile.TemporaryDirectory(prefix="declattn-bench-kv-") as kv:
        spec = {"model": model, "tokens": cfg.tokens, "seed": cfg.seed, "threads": threads,
                "max_tokens": cfg.max_tokens, "kv_cache_dir": kv}
        say("cold process: question 1 (whole prefill), then question 2 (from memory)")
        cold = _spawn(spec | {"ask": [0, 1]})
        files = scan(Path(kv)).chunks
        say("new process: question 1 again (the document from disk)")
        new = _spawn(spec | {"ask": [0]})
    first, second = cold["rows"]
    again = new["rows"][0]
    disk_bytes = sum(c.size for c in files)
    disk_tokens = sum(c.meta.tokens for c in files)
    return {
        "cold": first, "in_process_second": second, "new_process": again,
        "startup_seconds": {"cold": cold["startup_seconds"], "new": new["startup_seconds"]},
        "new_over_cold": again["ttft_seconds"] / first["ttft_seconds"],
        "new_over_in_process": again["ttft_seconds"] / second["ttft_seconds"],
        "goals": {"new_over_cold": GOAL_OVER_COLD, "new_over_in_process": GOAL_OVER_IN_PROCESS},
        "disk_files": len(files), "disk_bytes": disk_bytes,
        "disk_bytes_per_cached_token": disk_bytes / disk_tokens if disk_tokens else None,
        "kv_bytes_per_token": cold["kv_bytes_per_token"], "kv_dtype": cold["kv_dtype"],
    }
