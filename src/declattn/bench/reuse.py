"""``declattn bench reuse``: many questions over one document, prefilled once.

A session asks ``questions`` questions over one planted-fact document (one fact per
question) through ``Document.ask``: the first pays the document's prefill, the others
take its K/V from the prefix cache and pay only for their own tail. Beside it, in the
same process, ``independent`` of the same questions run on a pool without the cache,
each paying the whole prefill: what a client gets from an engine that keeps no K/V.
Reported, side by side: time to first token of each question (its prefill, the first
token included), wall time, cached tokens, and the two ratios the issue asks for —
TTFT of questions 2.. against question 1, and the whole session against the same
number of independent requests (the independent requests' mean wall time times the
number of questions when fewer were run; the report says which).

``--across-processes`` asks across processes instead (``reuse_processes.py``): a cold
question in a fresh process, the same question in a new one (read from the disk tier).

``--server`` repeats it through ``declattn serve``'s app on loopback with the ``openai``
client: streamed requests, TTFT = the first streamed chunk.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from declattn.api import Engine
from declattn.corpora.essays import planted_document, planted_fact
from declattn.protocol.segment import token_counter


@dataclass(frozen=True)
class ReuseConfig:
    tokens: int = 16_000
    questions: int = 5
    independent: int = 2
    max_tokens: int = 96
    seed: int = 0
    server: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Asked:
    """One question's timing."""

    question: str
    expected: str
    answer: str | None
    ttft_seconds: float
    wall_seconds: float
    prompt_tokens: int
    cached_tokens: int
    disk_tokens: int = 0
    """Of ``cached_tokens``, read from the prefix cache's disk tier."""

    @property
    def correct(self) -> bool:
        return self.expected.lower() in (self.answer or "").lower()


def questions_document(engine: Engine, cfg: ReuseConfig) -> tuple[str, list[tuple[str, str]]]:
    """A planted-fact document with one fact per question, and ``(question, answer)``s."""
    facts, seen = [], set()
    seed = cfg.seed
    while len(facts) < cfg.questions:
        fact = planted_fact(seed)
        seed += 1
        key = " ".join(fact[0].split()[:4])
        if key not in seen:  # distinct facts: each question has one answer
            seen.add(key)
            facts.append(fact)
    count = token_counter(engine.tokenizer)
    doc = planted_document(
        count, cfg.tokens, facts[0][0], cfg.seed, more_facts=[f[0] for f in facts[1:]]
    )
    return doc.text, [(q, a) for _, q, a in facts]


def ask_document(document: Any, question: str, expected: str, max_tokens: int) -> Asked:
    t0 = time.perf_counter()
    ans = document.ask(question, max_tokens=max_tokens)
    wall = time.perf_counter() - t0
    s = ans.stats
    return Asked(question, expected, ans.answer, s.prefill_seconds, wall, s.prompt_tokens,
                 s.cached_tokens, s.disk_tokens)


def run_reuse(
    engine: Engine, cfg: ReuseConfig, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The session and the independent requests through the engine (and the server)."""
    say = log or (lambda _m: None)
    text, qa = questions_document(engine, cfg)
    result: dict[str, Any] = {"config": cfg.to_dict(), "document_characters": len(text)}
    cached = engine.with_pool(engine.pool.num_blocks)
    fresh = engine.with_pool(engine.pool.num_blocks, prefix_caching=False)
    session = []
    doc = cached.open(text)
    for i, (q, a) in enumerate(qa, 1):
        say(f"engine session, question {i}/{len(qa)}")
        session.append(ask_document(doc, q, a, cfg.max_tokens))
    alone = []
    for i, (q, a) in enumerate(qa[: cfg.independent], 1):
        say(f"engine, independent request {i}/{cfg.independent}")
        alone.append(ask_document(fresh.open(text), q, a, cfg.max_tokens))
    result["engine"] = summarise(session, alone, len(qa))
    if cfg.server:
        result["server"] = run_server(engine, text, qa, cfg, say)
    return result


def summarise(session: list[Asked], alone: list[Asked], n: int) -> dict[str, Any]:
    """The per-question rows and the two ratios."""
    first = session[0]
    later = session[1:]
    out: dict[str, Any] = {
        "session": [asdict(a) | {"correct": a.correct} for a in session],
        "independent": [asdict(a) | {"correct": a.correct} for a in alone],
        "ttft_later_over_first": [a.ttft_seconds / first.ttft_seconds for a in later],
        "session_seconds": sum(a.wall_seconds for a in session),
    }
    if later:
        out["ttft_later_over_first_max"] = max(out["ttft_later_over_first"])
    if alone:
        mean = statistics.mean(a.wall_seconds for a in alone)
        out["independent_mean_seconds"] = mean
        out["independent_measured"] = len(alone)
        out["session_over_independent"] = out["session_seconds"] / (mean * n)
    return out


def run_server(
    engine: Engine,
    text: str,
    qa: list[tuple[str, str]],
    cfg: ReuseConfig,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The same through the OpenAI-compatible server, streamed with the openai client."""
    import openai

    out = {}
    for caching in (True, False):
        url, stop = _serve(engine, caching)
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
            rows = []
            todo = qa if caching else qa[: cfg.independent]
            for i, (q, a) in enumerate(todo, 1):
                say(f"server ({'cache' if caching else 'no cache'}), question {i}/{len(todo)}")
                rows.append(_ask_server(client, text, q, a, cfg.max_tokens))
            out["session" if caching else "independent"] = rows
        finally:
            stop()
    return summarise(out["session"], out["independent"], len(qa))


def _serve(engine: Engine, caching: bool) -> tuple[str, Callable[[], None]]:
    import socket

    import uvicorn

    from declattn.server.app import ServerConfig, create_app

    blocks = engine.pool.num_blocks
    app = create_app(engine, ServerConfig(model_id="bench", kv_blocks=blocks,
                                          prefix_caching=caching))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the benchmark server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(60)

    return f"http://127.0.0.1:{port}/v1", stop


def _ask_server(client: Any, text: str, question: str, expected: str, max_tokens: int) -> Asked:
    t0 = time.perf_counter()
    first = None
    pieces, usage = [], None
    stream = client.chat.completions.create(
        model="bench", temperature=0, max_tokens=max_tokens, stream=True,
        messages=[{"role": "user", "content": question}],
        extra_body={"declarative_attention": {"context": text}},
    )
    for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    wall = time.perf_counter() - t0
    extra = usage.model_extra if usage is not None else {}
    da = (extra or {}).get("declarative_attention", {})
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage is not None else 0
    return Asked(question, expected, da.get("answer"), first or wall, wall,
                 usage.prompt_tokens if usage else 0, cached)
