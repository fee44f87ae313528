"""Counters and gauges in the Prometheus text format (version 0.0.4), written by hand.

The counters are bumped from two threads (the event loop counts responses by status,
the stepping thread counts tokens), so every update takes the lock. Gauges are not
stored here: ``render`` reads them from the scheduler's latest snapshot.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Metrics:
    """Process-lifetime counters of one server."""

    requests: Counter = field(default_factory=Counter)
    generated_tokens: int = 0
    prompt_tokens: int = 0
    attended_tokens: int = 0
    vanilla_attended_tokens: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_queue_full: int = 0
    queue_wait_seconds: float = 0.0
    admitted: int = 0
    preemptions: int = 0
    prompt_sources: Counter = field(default_factory=Counter)
    """Prompt tokens of finished requests by where their KV came from (memory, disk,
    computed)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_tokens(self, n: int) -> None:
        with self._lock:
            self.generated_tokens += n

    def count_finished(
        self, prompt: int, attended: int, vanilla: int, preemptions: int = 0
    ) -> None:
        with self._lock:
            self.finished += 1
            self.preemptions += preemptions
            self.prompt_tokens += prompt
            self.attended_tokens += attended
            self.vanilla_attended_tokens += vanilla

    def count_prompt_sources(
        self, memory_tokens: int, disk_tokens: int, computed_tokens: int
    ) -> None:
        with self._lock:
            self.prompt_sources.update(
                memory=memory_tokens, disk=disk_tokens, computed=computed_tokens
            )

    def count_failed(self) -> None:
        with self._lock:
            self.failed += 1

    def count_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def count_rejected(self) -> None:
        with self._lock:
            self.rejected_queue_full += 1

    def observe_queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.admitted += 1
            self.queue_wait_seconds += seconds

    def render(self, snapshot: Any, pool_blocks: int) -> str:
        """The exposition text; ``snapshot`` is a ``scheduler.Snapshot``."""
        with self._lock:
            requests = dict(self.requests)
            counters = [
                ("generated_tokens_total", "tokens generated", self.generated_tokens),
                ("prompt_tokens_total", "prompt tokens of finished requests", self.prompt_tokens),
                (
                    "attended_tokens_total",
                    "KV positions read by decode steps of finished requests",
                    self.attended_tokens,
                ),
                (
                    "vanilla_attended_tokens_total",
                    "KV positions full attention would have read on the same steps",
                    self.vanilla_attended_tokens,
                ),
                ("requests_finished_total", "requests that ran to a finish", self.finished),
                ("requests_failed_total", "requests failed inside the engine", self.failed),
                ("requests_cancelled_total", "requests cancelled by a disconnect",
                 self.cancelled),
                ("requests_rejected_total", "requests refused with 503 (queue full)",
                 self.rejected_queue_full),
                ("queue_wait_seconds_total", "seconds admitted requests waited in the queue",
                 self.queue_wait_seconds),
                ("requests_admitted_total", "requests admitted to the running batch",
                 self.admitted),
                ("preemptions_total",
                 "times a finished request gave its KV blocks to others and recomputed them",
                 self.preemptions),
                ("prompt_tokens_from_memory_total",
                 "prompt tokens whose KV came from the prefix cache in memory",
                 self.prompt_sources["memory"]),
                ("prompt_tokens_from_disk_total",
                 "prompt tokens whose KV came from the prefix cache's disk tier",
                 self.prompt_sources["disk"]),
                ("prompt_tokens_computed_total", "prompt tokens prefilled",
                 self.prompt_sources["computed"]),
            ]
        lines = [
            "# HELP declattn_requests_total HTTP requests by endpoint and status code.",
            "# TYPE declattn_requests_total counter",
        ]
        for (endpoint, status), n in sorted(requests.items()):
            lines.append(
                f'declattn_requests_total{{endpoint="{_label(endpoint)}",status="{status}"}} {n}'
            )
        for name, help_text, value in counters:
            lines += [
                f"# HELP declattn_{name} {help_text}.",
                f"# TYPE declattn_{name} counter",
                f"declattn_{name} {value}",
            ]
        gauges = [
            ("queue_depth", "requests waiting for admission", snapshot.queued),
            ("running", "sequences in the running batch (decoding)", snapshot.running),
            ("prefilling", "admitted sequences not yet prefilled", snapshot.prefilling),
            ("kv_blocks_in_use", "KV blocks held (reserved) by sequences",
             snapshot.blocks_in_use),
            ("kv_blocks_free", "KV blocks free (cached ones included: evicted on demand)",
             snapshot.blocks_free),
            ("kv_blocks_cached", "KV blocks no request holds that keep a cached prefix",
             snapshot.blocks_cached),
            ("prefix_cache_hit_rate",
             "prompt blocks found in the prefix cache over those looked up, since start",
             snapshot.cache_hits / snapshot.cache_lookups if snapshot.cache_lookups else 0.0),
            ("kv_blocks_total", "KV blocks in the pool", pool_blocks),
        ]
        for name, help_text, value in gauges:
            lines += [
                f"# HELP declattn_{name} {help_text}.",
                f"# TYPE declattn_{name} gauge",
                f"declattn_{name} {value}",
            ]
        lines += [
            "# HELP declattn_prefix_cache_hit_blocks_total Prompt blocks taken from the cache.",
            "# TYPE declattn_prefix_cache_hit_blocks_total counter",
            f"declattn_prefix_cache_hit_blocks_total {snapshot.cache_hits}",
            "# HELP declattn_prefix_cache_lookup_blocks_total Prompt blocks looked up.",
            "# TYPE declattn_prefix_cache_lookup_blocks_total counter",
            f"declattn_prefix_cache_lookup_blocks_total {snapshot.cache_lookups}",
            "# HELP declattn_engine_steps_total Engine steps taken (prefill chunks and decode).",
            "# TYPE declattn_engine_steps_total counter",
            f"declattn_engine_steps_total {snapshot.steps}",
        ]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse(text: str) -> dict[str, float]:
    """Samples of an exposition text by name with labels (``name{a="b"}``); for tests
    and clients that want one figure without a Prometheus library."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
