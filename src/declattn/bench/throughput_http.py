"""``declattn bench throughput``, HTTP view: the same load through real servers.

For each context and concurrency N, N requests over distinct documents are sent at once
(streamed, the ``openai`` client) to each arm in turn, the order rotating per context:

- ``declattn vanilla``: the document and the question in one user message;
- ``declattn da``: the shipped DA default (``declarative_attention: {"context": ...}``);
- ``llama-server fa=on`` / ``fa=off``: llama.cpp's server on the same GGUF, ``-np N``
  slots with continuous batching, the vanilla messages (its own chat template).

Every arm prefills for real (its time to first token is part of the figure). Each arm is
a fresh server process with the same threads; documents differ between arms and repeats,
so no prompt cache helps any of them.

The arrival scenario: a few streams decode while requests with long prompts arrive at
Poisson times (bounded in count and seconds); the running streams' gaps between chunks
are what a prefill costs them, measured with mixed steps (at several budgets) and with
the older prefill-first scheduling.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from declattn.bench.http_load import (
    ServerProcess,
    Stream,
    concurrent,
    declattn_server,
    llama_server,
    pct,
    stream_chat,
    stream_until,
    summary,
)
from declattn.bench.throughput import document
from declattn.bench.transcript import QUESTION

HTTP_ARMS = ("declattn-vanilla", "declattn-da", "llama-fa-on", "llama-fa-off")


@dataclass(frozen=True)
class HttpConfig:
    model: str = "qwen2.5-0.5b"
    contexts: tuple[int, ...] = (8192, 16384, 32768)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    arms: tuple[str, ...] = HTTP_ARMS
    max_tokens: int = 128
    threads: int = 2
    llama_server: str = ".venv-bench/bin/llama-server"
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(HTTP_ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {', '.join(HTTP_ARMS)}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads: a number of threads (>= 1), not {self.threads!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _messages(doc: str, da: bool) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """One request's messages and extra body; ``ignore_eos`` (both servers take it) so that
    every arm writes ``max_tokens`` tokens, whatever its reply would have been."""
    if da:
        return ([{"role": "user", "content": QUESTION}],
                {"declarative_attention": {"context": doc}, "ignore_eos": True})
    return [{"role": "user", "content": f"{doc}\n\n{QUESTION}"}], {"ignore_eos": True}


def _server(arm: str, cfg: HttpConfig, gguf: Path, context: int, n: int) -> ServerProcess:
    ctx = context + cfg.max_tokens + 512  # the template and the question
    if arm.startswith("llama"):
        return llama_server(cfg.llama_server, gguf, threads=cfg.threads, slots=n,
                            ctx_per_slot=ctx, flash_attn=arm.endswith("on"))
    blocks = n * (-(-ctx // cfg.block_size) + 2)
    return declattn_server(cfg.model, threads=cfg.threads, kv_blocks=blocks, max_batch=n)


def run_http(cfg: HttpConfig, tokenizer: Any, gguf: Path,
             log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every context x concurrency x arm of ``cfg``: one summary each."""
    say = log or (lambda _m: None)
    results = []
    salt = cfg.seed * 100_000
    for ci, context in enumerate(cfg.contexts):
        order = cfg.arms[ci % len(cfg.arms):] + cfg.arms[: ci % len(cfg.arms)]
        for n in cfg.concurrency:
            for arm in order:
                salt += n
                docs = [document(tokenizer, context, salt + i) for i in range(n)]
                requests = [_messages(d, arm == "declattn-da") for d in docs]
                server = _server(arm, cfg, gguf, context, n)
                try:
                    rss = server.rss_mb
                    streams = concurrent(server.url, cfg.model, requests, cfg.max_tokens)
                    row = {"context": context, "n": n, "arm": arm, **summary(streams),
                           "server_rss_mb_idle": rss, "server_rss_mb_after": server.rss_mb}
                finally:
                    server.stop()
                say(f"{arm} x{n} at {context:,}: "
                    f"{row.get('tokens_per_second', float('nan')):.2f} tok/s, gap p99 "
                    f"{row.get('gap_p99') or float('nan'):.3f} s")
                results.append(row)
    return results


@dataclass(frozen=True)
class ArrivalConfig:
    """``streams`` decode over short prompts (raw completions that count on, up to
    ``stream_tokens``, dropped once every arrival has its answer) while ``arrivals``
    requests of ``context`` tokens arrive, ``rate`` per second on average (Poisson),
    within ``seconds``. Each scheduling in ``budgets`` (``0``: prefill-first) gets a
    server of its own."""

    model: str = "qwen2.5-0.5b"
    context: int = 16384
    streams: int = 4
    stream_tokens: int = 4096
    arrivals: int = 2
    rate: float = 0.05
    seconds: float = 900.0
    budgets: tuple[int, ...] = (0, 128, 256, 512)
    max_tokens: int = 16
    threads: int = 2
    block_size: int = 16
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _arrivals(cfg: ArrivalConfig, budget: int, tokenizer: Any) -> dict[str, Any]:
    """One scheduling under the arrival load."""
    ctx = cfg.context + cfg.max_tokens + 512
    per = -(-ctx // cfg.block_size) + 2
    blocks = (cfg.arrivals + 1) * per + cfg.streams * (-(-cfg.stream_tokens // cfg.block_size) + 4)
    server = declattn_server(
        cfg.model, threads=cfg.threads, kv_blocks=blocks,
        max_batch=cfg.streams + cfg.arrivals, prefill_budget=budget or None,
        prefill_first=budget == 0,
    )
    rng = random.Random(cfg.seed)
    background: list[Stream] = []
    arrived: list[Stream] = []
    lock = threading.Lock()
    done = threading.Event()

    def stream(i: int) -> None:
        count = ", ".join(str(k) for k in range(1 + i, 9 + i)) + ","  # the model counts on
        out = stream_until(server.url, cfg.model, count, cfg.stream_tokens, done)
        with lock:
            background.append(out)

    def arrive(i: int, at: float) -> None:
        doc = document(tokenizer, cfg.context, cfg.seed * 1000 + 500 + i + budget)
        msgs, _ = _messages(doc, False)
        out = stream_chat(server.url, cfg.model, msgs, cfg.max_tokens, sent=at)
        with lock:
            arrived.append(out)

    try:
        streams = [threading.Thread(target=stream, args=(i,), daemon=True)
                   for i in range(cfg.streams)]
        for t in streams:
            t.start()
        time.sleep(5.0)  # the streams' prompts are short: they are decoding by now
        start = time.monotonic()
        at = start
        arrivals = []
        for i in range(cfg.arrivals):
            at += rng.expovariate(cfg.rate)
            if at - start > cfg.seconds:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            t = threading.Thread(target=arrive, args=(i, time.monotonic()), daemon=True)
            t.start()
            arrivals.append(t)
        for t in arrivals:
            t.join(cfg.seconds + 3600)
        done.set()  # the streams go away once every arrival has its answer
        for t in streams:
            t.join(600)
        window = (start, max((s.chunks[-1] for s in arrived if s.chunks), default=start))
        doc = document(tokenizer, cfg.context, cfg.seed * 1000 + 900 + budget)
        alone = stream_chat(server.url, cfg.model, _messages(doc, False)[0], cfg.max_tokens)
    finally:
        server.stop()
    gaps = [b - a for s in background for a, b in zip(s.chunks, s.chunks[1:], strict=False)
            if window[0] <= a <= window[1]]
    ttft = [s.ttft for s in arrived if s.ttft is not None]
    return {
        "scheduling": "prefill-first" if budget == 0 else f"mixed, budget {budget}",
        "prefill_budget": budget or None,
        "arrived": len(arrived),
        "errors": [s.error for s in [*background, *arrived] if s.error][:5],
        "stream_gap_p50": pct(gaps, 50),
        "stream_gap_p99": pct(gaps, 99),
        "stream_gap_max": max(gaps) if gaps else None,
        "arrival_ttft": ttft,
        "arrival_prompt_tokens": [s.prompt_tokens for s in arrived],
        "ttft_alone": alone.ttft,
        "ttft_over_alone_max": max(ttft) / alone.ttft if ttft and alone.ttft else None,
    }


def run_arrivals(cfg: ArrivalConfig, tokenizer: Any,
                 log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Each scheduling of ``cfg.budgets`` under the same arrival schedule."""
    say = log or (lambda _m: None)
    out = []
    for budget in cfg.budgets:
        row = _arrivals(cfg, budget, tokenizer)
        say(f"{row['scheduling']}: stream gap p99 {row['stream_gap_p99']}, max "
            f"{row['stream_gap_max']}, arrival TTFT {row['arrival_ttft']}")
        out.append(row)
    return out
