"""Continuous batching through the real server and the official ``openai`` client.

The same mixed set of greedy requests (DA and plain) is run one at a time, then all at
once: every request must stream the same text both ways, and the concurrent run must
take fewer engine steps (requests really shared decode steps).

``DECLATTN_SERVER_CONCURRENCY=64`` runs the comparison with 64 requests and prints
throughput and p50/p95 latency of both runs (``pytest -s`` to see them);
``DECLATTN_SERVER_MAX_TOKENS`` changes the responses' length (default 10).
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import MODEL, request_body, start_server

from declattn.server.metrics import parse

openai = pytest.importorskip("openai")

N = int(os.environ.get("DECLATTN_SERVER_CONCURRENCY", "16"))
MAX_TOKENS = int(os.environ.get("DECLATTN_SERVER_MAX_TOKENS", "10"))


@dataclass
class Result:
    text: str
    seconds: float
    finish_reason: str | None


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(max_batch=64, kv_blocks=max(1024, 24 * N))


def _metrics(server: Any) -> dict[str, float]:
    return parse(httpx.get(server.url + "/metrics").text)


def _stream(client: Any, i: int) -> Result:
    body = request_body(i, max_tokens=MAX_TOKENS)
    extra = {}
    if "declarative_attention" in body:
        extra["declarative_attention"] = body["declarative_attention"]
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=body["messages"],
        temperature=0.0,
        max_tokens=body["max_tokens"],
        stream=True,
        extra_body=extra or None,
    )
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return Result("".join(pieces), time.perf_counter() - t0, finish)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_concurrent_streams_equal_one_at_a_time(server: Any) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=900)
    _stream(client, 0)  # warm up: the first DA request builds the focus vocabulary

    steps0 = _metrics(server)["declattn_engine_steps_total"]
    t0 = time.perf_counter()
    alone = [_stream(client, i) for i in range(N)]
    alone_wall = time.perf_counter() - t0
    steps1 = _metrics(server)["declattn_engine_steps_total"]

    peak = {"running": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            m = _metrics(server)
            peak["running"] = max(peak["running"], m["declattn_running"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=N) as pool:
        together = list(pool.map(lambda i: _stream(client, i), range(N)))
    together_wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    steps2 = _metrics(server)["declattn_engine_steps_total"]

    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b.text == a.text, f"request {i} ({'DA' if i % 4 == 0 else 'plain'}) differs"
        assert b.finish_reason == a.finish_reason
    assert sum(bool(r.text) for r in alone) >= N // 2
    assert steps2 - steps1 < steps1 - steps0, "the concurrent run did not share steps"
    assert peak["running"] >= 2

    tokens = sum(len(r.text) for r in alone)
    lat_a = [r.seconds for r in alone]
    lat_b = [r.seconds for r in together]
    # one at a time, had all N arrived together: each waits for those before it
    queued = list(itertools.accumulate(lat_a))
    print(
        f"\n[{N} requests, 1 in 4 DA, max_tokens {MAX_TOKENS}] one at a time: "
        f"{alone_wall:.1f} s ({N / alone_wall:.2f} req/s), p50 {statistics.median(lat_a):.2f} s, "
        f"p95 {_pct(lat_a, 0.95):.2f} s (arriving together: p50 "
        f"{statistics.median(queued):.1f} s, p95 {_pct(queued, 0.95):.1f} s), steps "
        f"{steps1 - steps0:.0f} | concurrent: "
        f"{together_wall:.1f} s ({N / together_wall:.2f} req/s), p50 "
        f"{statistics.median(lat_b):.2f} s, p95 {_pct(lat_b, 0.95):.2f} s, steps "
        f"{steps2 - steps1:.0f}, peak running {peak['running']:.0f} | speed-up "
        f"{alone_wall / together_wall:.2f}x | {tokens} characters"
    )
    m = _metrics(server)
    assert m["declattn_kv_blocks_in_use"] == 0
    assert m["declattn_running"] == 0


@pytest.fixture(scope="module")
def bf16_invariant() -> Any:
    """SmolLM2 in bf16 (where batched CPU matmuls round differently from one row), served
    with ``batch_invariant``."""
    from declattn.cli.serve_cmd import load_engine

    srv = start_server(load_engine(MODEL, dtype="bf16"), max_batch=64, kv_blocks=1024,
                       batch_invariant=True)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_batch_invariant_bf16_streams_equal_one_at_a_time(bf16_invariant: Any) -> None:
    """The issue's finding: in bf16, 13 of 32 plain and 8 of 32 mixed greedy responses
    changed between concurrent and one-at-a-time runs. With ``--batch-invariant`` none
    may (12 requests here: bf16 is emulated on AVX2 and 32 took three minutes of the
    suite; ``DECLATTN_SERVER_CONCURRENCY`` sets it)."""
    n = min(N, 12) if "DECLATTN_SERVER_CONCURRENCY" not in os.environ else N
    client = openai.OpenAI(base_url=bf16_invariant.v1, api_key="unused", max_retries=0,
                           timeout=900)
    _stream(client, 0)
    t0 = time.perf_counter()
    alone = [_stream(client, i) for i in range(n)]
    alone_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        together = list(pool.map(lambda i: _stream(client, i), range(n)))
    together_wall = time.perf_counter() - t0
    differ = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a.text != b.text]
    first = (f"; request {differ[0]}: alone {alone[differ[0]].text!r}, batched "
             f"{together[differ[0]].text!r}") if differ else ""
    assert differ == [], f"{len(differ)} of {n} greedy responses changed when batched{first}"
    assert sum(bool(r.text) for r in alone) >= n // 2
    print(f"\n[bf16, --batch-invariant, {n} requests] one at a time {alone_wall:.1f} s, "
          f"concurrent {together_wall:.1f} s")
