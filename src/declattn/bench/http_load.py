"""Concurrent streaming load against an OpenAI-compatible server on loopback.

The servers under load are real processes: ``declattn serve`` and llama.cpp's
``llama-server`` (built by ``make bench-env`` from the llama.cpp source llama-cpp-python
vendors). The clients are the ``openai`` package's, as a user's would be, one thread
each, every request streamed so that each chunk's arrival is timed: time to first token,
the gaps between chunks (a chunk is a token on llama-server; declattn holds a tag back
until it is decided, so a DA chunk may carry a few), and the tokens the usage reports.
127.0.0.1 only; every run is bounded in requests and seconds.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

STARTUP_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (``nan`` where it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class ServerProcess:
    """A server subprocess on 127.0.0.1, up once ``/health`` answers 200."""

    def __init__(self, cmd: Sequence[str], port: int, threads: int, name: str) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{name} exited at start-up: {err[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not come up within {STARTUP_S:.0f} s")

    @property
    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def declattn_server(model: str, *, threads: int, kv_blocks: int, max_batch: int,
                    prefill_budget: int | None = None, prefill_first: bool = False,
                    dtype: str = "auto") -> ServerProcess:
    """``declattn serve`` with this interpreter's ``declattn``, its prefix cache in memory
    only: a bench's documents are new to it, and the disk tier would find them again in
    the next run with the same seed (and write every prefill to disk meanwhile)."""
    port = free_port()
    exe = Path(sys.executable).with_name("declattn")
    cmd = [str(exe), "serve", "--model", model, "--port", str(port), "--kv-blocks",
           str(kv_blocks), "--max-batch", str(max_batch), "--log-level", "warning",
           "--dtype", dtype, "--no-kv-disk"]
    if prefill_budget is not None:
        cmd += ["--prefill-budget", str(prefill_budget)]
    if prefill_first:
        cmd.append("--prefill-first")
    return ServerProcess(cmd, port, threads, "declattn serve")


def llama_server(binary: str, gguf: Path, *, threads: int, slots: int, ctx_per_slot: int,
                 flash_attn: bool) -> ServerProcess:
    """llama.cpp's server: ``slots`` parallel sequences, continuous batching."""
    if not Path(binary).is_file():
        raise FileNotFoundError(f"{binary}: no llama-server; build it with `make bench-env`")
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "--cont-batching", "-c", str(slots * ctx_per_slot),
           "-t", str(threads), "-tb", str(threads), "-fa", "on" if flash_attn else "off",
           "--no-webui"]
    return ServerProcess(cmd, port, threads, f"llama-server fa={'on' if flash_attn else 'off'}")


@dataclass
class Stream:
    """One streamed request as its client saw it (monotonic seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="bench", timeout=3600, max_retries=0)


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                extra: dict[str, Any] | None = None, sent: float | None = None) -> Stream:
    """One chat completion streamed through the ``openai`` client, each content chunk
    timed; the usage (asked for) gives the tokens."""
    out = Stream(sent if sent is not None else time.monotonic())
    try:
        stream = _client(url).chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra or {},
        )
        for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].delta.content:
                out.chunks.append(now)
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
                out.prompt_tokens = chunk.usage.prompt_tokens
    except Exception as e:  # reported with the run, never raised in a client thread
        out.error = f"{type(e).__name__}: {e}"
    return out


def stream_until(url: str, model: str, prompt: str, max_tokens: int,
                 stop: threading.Event) -> Stream:
    """A raw completion streamed until ``stop`` is set (then the client goes away) or it
    ends: a stream that keeps decoding while something else is measured."""
    out = Stream(time.monotonic())
    try:
        stream = _client(url).completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                out.chunks.append(time.monotonic())
            if stop.is_set():
                stream.close()
                break
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def concurrent(url: str, model: str, requests: Sequence[tuple[list[dict[str, str]],
                                                             dict[str, Any] | None]],
               max_tokens: int) -> list[Stream]:
    """``requests`` (messages, extra body) sent at once, one client thread each."""
    results: list[Stream | None] = [None] * len(requests)

    def one(i: int) -> None:
        messages, extra = requests[i]
        results[i] = stream_chat(url, model, messages, max_tokens, extra)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def pct(values: Sequence[float], q: int) -> float | None:
    """The ``q``-th percentile (inclusive), ``None`` for no values."""
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(streams: Sequence[Stream]) -> dict[str, Any]:
    """Aggregate output tokens/s (over the window where every stream was decoding, and
    over the whole run), TTFT and inter-chunk percentiles, errors."""
    ok = [s for s in streams if s.error is None and s.chunks]
    out: dict[str, Any] = {
        "requests": len(streams),
        "errors": [s.error for s in streams if s.error is not None][:5],
        "completion_tokens": sum(s.completion_tokens for s in ok),
        "prompt_tokens": [s.prompt_tokens for s in ok],
    }
    if not ok:
        return out
    first, last = min(s.sent for s in ok), max(s.chunks[-1] for s in ok)
    out["wall_seconds"] = last - first
    out["tokens_per_second"] = out["completion_tokens"] / max(1e-9, last - first)
    lo, hi = max(s.chunks[0] for s in ok), min(s.chunks[-1] for s in ok)
    if hi > lo:  # every stream between its first and its last chunk
        tokens = 0.0
        for s in ok:
            per_chunk = s.completion_tokens / len(s.chunks)
            tokens += per_chunk * sum(1 for t in s.chunks if lo < t <= hi)
        out["steady_tokens_per_second"] = tokens / (hi - lo)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps]
    out.update(
        ttft_p50=pct(ttft, 50), ttft_max=max(ttft),
        gap_p50=pct(gaps, 50), gap_p99=pct(gaps, 99), gap_max=max(gaps) if gaps else None,
    )
    return out
