"""``declattn bench throughput``, in-process view: N concurrent long-context requests
decoding together through the engine's batch API (``declattn.Engine.add``/``step``).

Each request reads a document of its own (a distinct first line, so no prefix is
shared). Arms, each over a KV pool of its own, stepped in alternation (blocks of steps,
the order rotating, a memory-bandwidth sample after each block: the same minutes, the
same neighbours):

- ``vanilla``: the plain prompt, every block read;
- ``da-focus``: the DA prompt, teacher-forced into a focus on one chunk and timed only
  once every request is in it (DA's steady state);
- ``da``: the shipped DA default with its real replies, global steps included. Its
  replies depend on the prompt's K/V, so it needs ``real_prefill``.

With ``real_prefill`` off (the default), the prompt K/V of the forced arms is synthetic
(``prefill_synthetic``: a decode step costs the same whatever values it reads, and a
real prefill of 8 x 16K tokens takes many minutes here); their outputs are forced, so
the values never matter. A step's bytes are the weights once plus each request's KV
blocks read (the read counter's), set beside the bandwidth probe.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from declattn.api import Engine, frozen_heap
from declattn.api.session import DASession, Session
from declattn.bench.http_load import pct
from declattn.bench.machine import BandwidthProbe
from declattn.bench.transcript import QUESTION, repeated_essay
from declattn.da.options import DAOptions
from declattn.engine.controller import Controller, Forced
from declattn.engine.request import Request
from declattn.engine.sampler import SamplingParams
from declattn.protocol.modes import Mode

FILLER = "Reading the chunk closely for the vault code of the north tower. "
ARMS = ("vanilla", "da-focus", "da")


@dataclass(frozen=True)
class InProcessConfig:
    """``warmup``/``steps``: decode steps per request before and during timing; ``block``:
    steps an arm runs before the next takes its turn."""

    contexts: tuple[int, ...] = (8192, 16384, 32768)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    arms: tuple[str, ...] = ("vanilla", "da-focus")
    warmup: int = 4
    steps: int = 32
    block: int = 8
    real_prefill: bool = False
    max_tokens_da: int = 256
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
        if "da" in self.arms and not self.real_prefill:
            raise ValueError("the 'da' arm writes real replies: it needs real_prefill")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def document(tokenizer: Any, n_tokens: int, index: int) -> str:
    """A document of about ``n_tokens`` tokens, distinct from every other ``index``'s
    from its first line on (no shared prefix)."""
    head = f"Document {index}: the records of lighthouse number {1000 + index}.\n\n"
    return head + repeated_essay(tokenizer, n_tokens, depth=0.3 + 0.4 * (index % 7) / 6)


@dataclass
class _Arm:
    name: str
    engine: Engine
    requests: list[Request]
    sessions: list[Session]
    start: int  # the decode step index from which steps are timed
    times: list[float] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.requests)


def _forced(engine: Engine, arm: str, doc: str, n_tokens: int) -> tuple[Session, Controller]:
    """The session and the teacher-forced controller of a forced arm's request."""
    tok = engine.tokenizer
    if arm == "vanilla":
        sess: Session = engine.session(doc, QUESTION, da=False)
        text = FILLER * (1 + n_tokens // 8)
    else:
        options = DAOptions(constrain=False, runaway=False, min_context=0)
        sess = DASession(tok, doc, QUESTION, options, engine.block_size)
        k = 1 + len(sess.chunks) // 2
        text = f'<focus magic_chunks="{k}">' + FILLER * (1 + n_tokens // 8)
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return sess, Forced(sess, ids)


def _arm(engine: Engine, arm: str, context: int, n: int, cfg: InProcessConfig,
         log: Callable[[str], None]) -> _Arm:
    """Requests of ``arm`` added to a pool of their own, prefilled, ready to decode."""
    tok = engine.tokenizer
    n_tokens = cfg.warmup + cfg.steps + 32
    docs = [document(tok, context, cfg.seed * 1000 + i) for i in range(n)]
    built = []
    for doc in docs:
        if arm == "da":
            # the gate weighs each request as one of the n decoding together
            sess = engine.session(doc, QUESTION, max_tokens=cfg.max_tokens_da, batch=n)
            built.append((sess, sess, cfg.max_tokens_da))
        else:
            sess, ctl = _forced(engine, arm, doc, n_tokens)
            built.append((sess, ctl, n_tokens))
    longest = max(len(s.prompt_ids) + m for s, _, m in built)
    blocks = n * (-(-longest // cfg.block_size) + 2)
    # prefill-first: with real prefills, mixed steps would decode the first prompts' replies
    # while the last ones prefill, and the timed steps would hold fewer than n requests
    pool = engine.with_pool(blocks, prefix_caching=False, prefill_first=True)
    reqs = [pool.add(ctl, SamplingParams(max_tokens=m, ignore_eos=arm != "da"))
            for _, ctl, m in built]
    t0 = time.perf_counter()
    if not cfg.real_prefill:
        gen = torch.Generator().manual_seed(cfg.seed)
        for r in reqs:
            pool.prefill_synthetic(r, generator=gen)
    while any(r.prefilled < len(r.prompt_ids) for r in reqs):
        pool.step()
    prefill = time.perf_counter() - t0
    log(f"{arm} x{n} at {context:,}: prompts {[len(r.prompt_ids) for r in reqs][:4]}..., "
        f"prefill {prefill:.1f} s ({'real' if cfg.real_prefill else 'synthetic K/V'})")
    start = 0
    if arm == "da-focus":  # the focus tag is written in global: time what follows it
        tag = len(tok.encode('<focus magic_chunks="1">', add_special_tokens=False))
        start = tag + 1
    start += cfg.warmup
    out = _Arm(arm, pool, reqs, [s for s, _, _ in built], start)
    out.prefill_seconds = prefill
    return out


def _step(a: _Arm) -> None:
    """One step of ``a``'s pool, timed once every request is past ``a.start``."""
    before = [len(r.reads) for r in a.requests]
    t0 = time.perf_counter()
    events = a.engine.step()
    dt = time.perf_counter() - t0
    if min(len(r.output_ids) for r in a.requests) <= a.start and a.name != "da":
        return
    a.times.append(dt)
    a.tokens.append(len(events))
    a.kv_bytes.append(sum(
        rd.global_bytes + rd.sliding_bytes
        for r, b in zip(a.requests, before, strict=True) for rd in r.reads[b:]
    ))


def _in_focus(a: _Arm) -> bool:
    """Whether every timed step of a focus arm's requests was in focus."""
    for sess in a.sessions:
        assert isinstance(sess, DASession)
        if any(rec.mode != Mode.FOCUS for rec in sess.steps[a.start :]):
            return False
    return True


def measure(engine: Engine, context: int, n: int, cfg: InProcessConfig,
            probe: BandwidthProbe, log: Callable[[str], None]) -> dict[str, Any]:
    """Every arm of ``cfg`` at ``context`` tokens and ``n`` requests, interleaved."""
    arms = [_arm(engine, name, context, n, cfg, log) for name in cfg.arms]
    weights = engine.loaded.model.weight_bytes_per_step()
    rounds = 0
    with frozen_heap():  # as the server decodes (``api/heap.py``)
        while not all(a.done or (a.name != "da" and len(a.times) >= cfg.steps) for a in arms):
            order = arms[rounds % len(arms):] + arms[: rounds % len(arms)]
            for a in order:
                for _ in range(cfg.block):
                    if a.done or (a.name != "da" and len(a.times) >= cfg.steps):
                        break
                    _step(a)
            probe.sample()
            rounds += 1
    read_bw = probe.result().read_median
    out: dict[str, Any] = {"context": context, "n": n, "weight_bytes_per_step": weights,
                           "probe_read_bytes_per_s": read_bw, "arms": {}}
    for a in arms:
        times = a.times or [float("nan")]
        step = statistics.median(times)
        kv = statistics.median(a.kv_bytes) if a.kv_bytes else 0
        out["arms"][a.name] = {
            "prompt_tokens": [len(r.prompt_ids) for r in a.requests],
            "prefill_seconds": a.prefill_seconds,
            "timed_steps": len(a.times),
            "step_ms_p50": 1e3 * step,
            "inter_token_ms_p50": 1e3 * (pct(a.times, 50) or float("nan")),
            "inter_token_ms_p99": 1e3 * (pct(a.times, 99) or float("nan")),
            "tokens_per_second": sum(a.tokens) / max(1e-9, sum(a.times)),
            "kv_bytes_per_step": kv,
            "bytes_per_step": weights + kv,
            "read_bytes_per_s": (weights + kv) / step,
            "read_share_of_probe": (weights + kv) / step / read_bw,
            "roofline_step_ms": 1e3 * (weights + kv) / read_bw,
            "in_focus": _in_focus(a) if a.name == "da-focus" else None,
            "finish_reasons": sorted({str(r.finish_reason) for r in a.requests}),
        }
        for r in a.requests:
            if r.finish_reason is None:
                a.engine.abort(r)
    return out


@dataclass(frozen=True)
class BudgetConfig:
    """``streams`` requests decode at ``context`` tokens (synthetic K/V, forced output)
    while the last ``prompt_tokens`` of another ``context``-token prompt prefill for real
    beside them, once per prefill budget."""

    context: int = 16384
    streams: int = 4
    prompt_tokens: int = 2048
    budgets: tuple[int, ...] = (128, 256, 512)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ids(tokenizer: Any, n_tokens: int, index: int) -> list[int]:
    """``n_tokens`` token ids of document ``index`` (cut from a longer one)."""
    text = document(tokenizer, n_tokens + n_tokens // 4 + 64, index)
    return list(tokenizer.encode(text, add_special_tokens=False))[:n_tokens]


def budget_sweep(engine: Engine, cfg: BudgetConfig,
                 log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Per budget: the decode step alone, the mixed steps (what a stream waits between
    two tokens while the prompt prefills) and the prompt's prefill rate beside them."""
    say = log or (lambda _m: None)
    gen = torch.Generator().manual_seed(cfg.seed)
    tok = engine.tokenizer
    ids = _ids(tok, cfg.context, cfg.seed * 1000 + 99)
    real = min(cfg.prompt_tokens, len(ids) - 1)
    alone = _prefill_alone(engine, ids, real, gen)
    say(f"the prompt alone (default budget): {real} tokens in {alone:.1f} s")
    out = []
    for budget in cfg.budgets:
        blocks = (cfg.streams + 1) * (-(-cfg.context // 16) + 64)
        pool = engine.with_pool(blocks, prefix_caching=False, prefill_budget=budget)
        streams = []
        for i in range(cfg.streams):
            ids = _ids(tok, cfg.context, cfg.seed * 1000 + i)
            ctl = Forced(Controller(ids), tok.encode(FILLER * 64)[:400])
            req = pool.add(ctl, SamplingParams(max_tokens=400, ignore_eos=True))
            pool.prefill_synthetic(req, generator=gen)
            streams.append(req)
        while any(r.prefilled < len(r.prompt_ids) for r in streams):
            pool.step()
        decode = []
        for _ in range(4):
            t0 = time.perf_counter()
            pool.step()
            decode.append(time.perf_counter() - t0)
        new = pool.add(Controller(ids), SamplingParams(max_tokens=1))
        pool.prefill_synthetic(new, upto=len(ids) - real, generator=gen)
        mixed = []
        while new.finish_reason is None:
            t0 = time.perf_counter()
            pool.step()
            mixed.append(time.perf_counter() - t0)
        for r in streams:
            pool.abort(r)
        row = {"budget": budget, "decode_step_s": statistics.median(decode[1:]),
               "mixed_step_s_p50": statistics.median(mixed), "mixed_step_s_max": max(mixed),
               "prompt_tokens_per_s": real / sum(mixed), "steps": len(mixed),
               "prefill_s": sum(mixed), "alone_prefill_s": alone,
               "prefill_over_alone": sum(mixed) / alone}
        say(f"budget {budget}: mixed step p50 {row['mixed_step_s_p50']:.2f} s, prompt "
            f"{row['prompt_tokens_per_s']:.1f} tok/s")
        out.append(row)
    return out


def _prefill_alone(engine: Engine, ids: list[int], real: int, gen: torch.Generator) -> float:
    """Seconds to prefill the last ``real`` tokens of ``ids`` with nothing else running
    (the engine's default budget): what the prompt costs beside the streams is set
    against it."""
    pool = engine.with_pool(-(-len(ids) // 16) + 64, prefix_caching=False)
    req = pool.add(Controller(ids), SamplingParams(max_tokens=1))
    pool.prefill_synthetic(req, upto=len(ids) - real, generator=gen)
    t0 = time.perf_counter()
    while req.finish_reason is None:
        pool.step()
    return time.perf_counter() - t0
