"""``declattn bench reuse --across-processes``: the plumbing, never the timings (the
machines are shared): the cold process computes the document, its second question takes
it from memory, a new process reads it from disk, and the disk holds the K/V's bytes."""

from __future__ import annotations

from declattn.bench.reuse import ReuseConfig
from declattn.bench.reuse_processes import run_across_processes


def test_a_new_process_reads_the_document_from_disk() -> None:
    r = run_across_processes("smollm2-135m", ReuseConfig(tokens=1200, max_tokens=4), 1)
    cold, second, new = r["cold"], r["in_process_second"], r["new_process"]
    assert cold["cached_tokens"] == 0
    assert second["cached_tokens"] >= 512 and second["disk_tokens"] == 0
    assert new["disk_tokens"] == new["cached_tokens"] >= 512
    assert new["prompt_tokens"] == cold["prompt_tokens"]
    assert r["disk_files"] >= new["disk_tokens"] // 512
    per_token = r["disk_bytes_per_cached_token"]
    assert r["kv_bytes_per_token"] <= per_token < 1.01 * r["kv_bytes_per_token"]
    assert r["new_over_cold"] > 0 and r["new_over_in_process"] > 0
