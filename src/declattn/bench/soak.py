"""``declattn bench serve``: a soak of the server under mixed, partly hostile traffic.

A real ``declattn serve`` process on loopback (127.0.0.1 only) receives, for a bounded
time and count, a mix from ``clients`` threads (8 at once by default, for 30 minutes):
plain chat, DA chat, streamed requests the client drops part way, oversize and malformed
bodies, long replies and long documents. It reports requests served, 4xx/5xx counts
(5xx must be 0), latency percentiles of the short requests (the ones a long request must
not hold up), blocks in use at the end (must be 0), and the server's resident memory:
idle, after its first request, and sampled every ``rss_every_s`` through the soak (a
plateau, not a climb: the growth after minute 5 is reported). A measurement, never a
test: the machines are shared.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from declattn.bench.http_load import free_port, rss_mb
from declattn.server.metrics import parse

KINDS = ("plain", "da", "stream_drop", "oversize", "malformed", "long", "long_context")
WEIGHTS = (0.30, 0.22, 0.12, 0.07, 0.09, 0.10, 0.10)
SETTLE_S = 300.0
"""RSS growth is measured from this far into the soak (start-up and first-use costs
are paid by then)."""


@dataclass(frozen=True)
class SoakConfig:
    """``long_tokens``: the document of a ``long_context`` request (DA over it)."""

    model: str = "smollm2-135m"
    seconds: float = 1800.0
    max_requests: int = 20000
    clients: int = 8
    kv_blocks: int = 2048
    seed: int = 0
    max_request_bytes: int = 1 << 20
    rss_every_s: float = 10.0
    long_tokens: int = 4096

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Tally:
    """What the clients saw, under one lock."""

    status: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    short_latency: list[float] = field(default_factory=list)
    short_latency_during_long: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    long_running: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class RssSampler:
    """The server's resident memory every ``every_s`` seconds, in a thread of its own."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []  # (seconds into the soak, MB)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - self._t0, 1), rss_mb(self.pid)))
            self._stop.wait(self.every_s)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(self.every_s + 5)
        return self.samples


def rss_growth(samples: list[tuple[float, float]], settle_s: float = SETTLE_S) -> float | None:
    """Growth of the last sample over the first one at or after ``settle_s`` (``None``
    for a soak shorter than that)."""
    later = [mb for t, mb in samples if t >= settle_s]
    if len(later) < 2:
        return None
    return later[-1] / later[0] - 1.0


def _start(cfg: SoakConfig, port: int, kv_cache_dir: str) -> subprocess.Popen:
    """The server, its prefix cache's disk tier in ``kv_cache_dir`` (the soak's traffic
    exercises it, and stays out of the user's cache)."""
    exe = Path(sys.executable).with_name("declattn")
    cmd = [
        str(exe), "serve", "--model", cfg.model, "--port", str(port),
        "--kv-blocks", str(cfg.kv_blocks), "--max-request-bytes", str(cfg.max_request_bytes),
        "--log-level", "warning", "--dtype", "fp32", "--kv-cache-dir", kv_cache_dir,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up within 300 s")


_DOC = "\n\n".join(
    f"Note {i}: the ferry to island {i} leaves at {6 + i % 12}:{(7 * i) % 60:02d}."
    for i in range(40)
)


def long_document(n_tokens: int) -> str:
    """About ``n_tokens`` tokens of notes (four characters a token, roughly)."""
    lines, i = [], 0
    while sum(len(x) for x in lines) < 4 * n_tokens:
        lines.append(f"Record {i}: the lamp of tower {i % 97} was lit at "
                     f"{(5 * i) % 24}:{(11 * i) % 60:02d} by keeper {i % 13}.")
        i += 1
    return "\n\n".join(lines)


def _request(kind: str, rng: random.Random, cfg: SoakConfig) -> tuple[str, Any, bool]:
    """``(content type, body, streamed)`` of one request of ``kind``."""
    base = {"model": cfg.model, "temperature": 0, "max_tokens": 12}
    user = [{"role": "user", "content": f"Say something about ferry {rng.randrange(40)}."}]
    if kind == "plain":
        return "json", {**base, "messages": user}, False
    if kind == "da":
        return "json", {**base, "messages": user, "max_tokens": 24,
                        "declarative_attention": {"context": _DOC, "chunk_tokens": 128}}, False
    if kind == "stream_drop":
        return "json", {**base, "messages": user, "max_tokens": 64, "stream": True}, True
    if kind == "long":
        return "json", {**base, "messages": user, "max_tokens": 400}, False
    if kind == "long_context":
        ask = [{"role": "user", "content": f"When was the lamp of tower {rng.randrange(97)} lit?"}]
        return "json", {**base, "messages": ask, "max_tokens": 48, "declarative_attention": {
            "context": long_document(cfg.long_tokens)}}, False
    if kind == "oversize":
        return "raw", b'{"model": "x", "messages": [' + b" " * (cfg.max_request_bytes + 10), False
    bad = rng.choice([b"{not json", b'{"model": 7}', b'{"model": "\\ud800", "messages": []}',
                      b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": -3}'])
    return "raw", bad, False


def _client(cfg: SoakConfig, url: str, tally: Tally, stop_at: float, budget: list[int],
            seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as http:
        while time.monotonic() < stop_at:
            with tally.lock:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
            kind = rng.choices(KINDS, WEIGHTS)[0]
            _one(http, kind, rng, cfg, tally)


def _one(http: httpx.Client, kind: str, rng: random.Random, cfg: SoakConfig, tally: Tally) -> None:
    ctype, body, streamed = _request(kind, rng, cfg)
    t0 = time.monotonic()
    during_long = tally.long_running > 0
    if kind in ("long", "long_context"):
        with tally.lock:
            tally.long_running += 1
    try:
        if ctype == "raw":
            r = http.post("/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"})
            status = r.status_code
        elif streamed:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                status = r.status_code
                for i, _ in enumerate(r.iter_lines()):
                    if i >= rng.randrange(1, 8):
                        break  # the client goes away mid-stream
        else:
            status = http.post("/v1/chat/completions", json=body).status_code
    except httpx.HTTPError as e:
        status = -1
        with tally.lock:
            tally.errors.append(f"{kind}: {type(e).__name__}: {e}")
    finally:
        if kind in ("long", "long_context"):
            with tally.lock:
                tally.long_running -= 1
    elapsed = time.monotonic() - t0
    with tally.lock:
        tally.status[status] += 1
        tally.kinds[kind] += 1
        if kind in ("plain", "da") and status == 200:
            tally.short_latency.append(elapsed)
            if during_long:
                tally.short_latency_during_long.append(elapsed)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def run_soak(cfg: SoakConfig, log: Any = None) -> dict[str, Any]:
    """Start the server, soak it, stop it; the report."""
    say = log or (lambda _m: None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    say(f"starting declattn serve on {url}")
    kv = tempfile.TemporaryDirectory(prefix="declattn-soak-kv-")
    proc = _start(cfg, port, kv.name)
    try:
        rss_before = rss_mb(proc.pid)
        first = {"model": cfg.model, "max_tokens": 8, "temperature": 0,
                 "messages": [{"role": "user", "content": "Hello."}]}
        httpx.post(url + "/v1/chat/completions", json=first, timeout=600)
        rss_first = rss_mb(proc.pid)
        sampler = RssSampler(proc.pid, cfg.rss_every_s)
        tally = Tally()
        budget = [cfg.max_requests]
        stop_at = time.monotonic() + cfg.seconds
        threads = [threading.Thread(target=_client, args=(cfg, url, tally, stop_at, budget,
                                                          cfg.seed + i), daemon=True)
                   for i in range(cfg.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg.seconds + 900)
        wall = time.monotonic() - t0
        time.sleep(2)  # cancelled streams free their blocks between steps
        metrics = parse(httpx.get(url + "/metrics", timeout=30).text)
        rss_after = rss_mb(proc.pid)
        samples = sampler.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        kv.cleanup()
    codes = tally.status
    return {
        "config": cfg.to_dict(),
        "wall_seconds": wall,
        "requests": sum(codes.values()),
        "by_kind": dict(tally.kinds),
        "by_status": {str(k): v for k, v in sorted(codes.items())},
        "served_2xx": sum(v for k, v in codes.items() if 200 <= k < 300),
        "client_4xx": sum(v for k, v in codes.items() if 400 <= k < 500),
        "server_5xx": sum(v for k, v in codes.items() if k >= 500),
        "transport_errors": tally.errors[:20],
        "short_p50_seconds": _pct(tally.short_latency, 50),
        "short_p95_seconds": _pct(tally.short_latency, 95),
        "short_p50_during_long_seconds": _pct(tally.short_latency_during_long, 50),
        "short_p95_during_long_seconds": _pct(tally.short_latency_during_long, 95),
        "blocks_in_use_at_end": metrics.get("declattn_kv_blocks_in_use"),
        "preemptions": metrics.get("declattn_preemptions_total"),
        "server_rss_mb_before": rss_before,
        "server_rss_mb_after_first_request": rss_first,
        "server_rss_mb_after": rss_after,
        "rss_samples_mb": samples,
        "rss_growth_after_5_min": rss_growth(samples),
    }


def write_report(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "soak.json"
    path.write_text(json.dumps(result, indent=1))
    return path
