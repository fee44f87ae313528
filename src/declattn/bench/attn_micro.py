"""Decode attention alone: time per step against the bytes each mode must read.

One decode row attends a synthetic KV cache through the engine's own path
(``PagedAttention`` over a ``KVCache``, views from ``Scope``), in a real model's layer
shape (Qwen2.5-0.5B by default: 24 layers, 14 query heads over 2 KV heads of 64, bf16).
Every arm — decode path (fused kernel, torch fallback) x threads x mode (global, focus,
local) — is interleaved in one loop with a bandwidth probe sampled at the same thread
count, and the caches are flushed before every step, as a real step's weight reads
would flush them, so a small view cannot win by sitting in L3.

Figures of merit: effective GB/s (bytes read / time) against the read bandwidth
measured in the same minutes, ``time / roofline`` (1.0: the step costs exactly its bytes),
and for DA modes ``time fraction / byte fraction`` against global (1.0: reading fewer
blocks saves time in proportion). Process CPU time is recorded beside wall time: on a
machine shared with busy neighbours it is the steadier of the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from declattn.bench.machine import BandwidthProbe, Timing, time_call
from declattn.da.scope import Scope
from declattn.engine.decode import kernel_in_use
from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.paged import PagedAttention
from declattn.engine.reads import ReadCounter
from declattn.engine.seq_step import SeqStep
from declattn.engine.threads import available_cores
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode

MODES = ("global", "focus", "local")
KERNELS = ("native", "torch")


@dataclass(frozen=True)
class MicroConfig:
    """Shape and schedule of the micro-benchmark.

    ``n_layers`` separate pools are read per step, as a model with that many global
    layers reads them. ``threads`` above the machine's cores are dropped; ``kernels``
    that cannot run here (no compiler for ``native``) are dropped and said so.
    """

    contexts: tuple[int, ...] = (4096, 16384, 32768)
    n_heads: int = 14
    n_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    n_layers: int = 24
    chunk_tokens: int = 2048
    focus_chunks: int = 1
    sink: int = 16
    question_tokens: int = 64
    response_tokens: int = 32
    repeats: int = 5
    dtype: str = "bfloat16"
    threads: tuple[int, ...] = (1, 2)
    kernels: tuple[str, ...] = KERNELS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synthetic_layout(context: int, chunk_tokens: int, sink: int, question: int) -> Layout:
    """A DA layout of ``context`` prompt tokens: a sink, chunks of ``chunk_tokens`` back
    to back, and a question window at the end (the last chunk may be short)."""
    if context < sink + question + 1:
        raise ValueError(f"context {context} is too short for sink + question")
    body_end = context - question
    chunks = tuple(
        Span(a, min(a + chunk_tokens, body_end)) for a in range(sink, body_end, chunk_tokens)
    )
    return Layout(context, Span(0, sink), chunks, Span(body_end, context))


def focus_ids(n_chunks: int, k: int) -> tuple[int, ...]:
    """``k`` chunk ids spread through the context (separate runs, as a real focus is)."""
    k = max(1, min(k, n_chunks))
    return tuple(sorted({min(n_chunks, 1 + (i + 1) * n_chunks // (k + 1)) for i in range(k)}))


def mode_views(layout: Layout, length: int, block_size: int, n_focus: int) -> dict[str, Any]:
    """The view of each mode at a step that reads ``length`` positions."""
    ids = focus_ids(layout.n_chunks, n_focus)
    scopes = {
        "global": Scope(layout),
        "focus": Scope(layout, Mode.FOCUS, ids),
        "local": Scope(layout, Mode.LOCAL),
    }
    views: dict[str, Any] = {m: s.kept_blocks(length, block_size) for m, s in scopes.items()}
    views["focus_ids"] = ids
    return views


@dataclass
class _Arm:
    kernel: str
    threads: int
    mode: str
    view: tuple[int, ...] | None
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    plans: list[float] = field(default_factory=list)


def _fill(cache: KVCache, seq_id: int, length: int, gen: torch.Generator) -> None:
    cache.allocate(seq_id, length)
    rows = cache.slots(seq_id, 0, length)
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    first_k, first_v = cache.k[0], cache.v[0]
    first_k[:, lo:hi].normal_(generator=gen)
    first_v[:, lo:hi].normal_(generator=gen)
    for pool in cache.k[1:]:
        pool[:, lo:hi].copy_(first_k[:, lo:hi])
    for pool in cache.v[1:]:
        pool[:, lo:hi].copy_(first_v[:, lo:hi])


def usable(cfg: MicroConfig, pool: torch.Tensor) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The thread counts and decode paths of ``cfg`` this machine can run."""
    threads = tuple(t for t in cfg.threads if 1 <= t <= available_cores()) or (1,)
    kernels = tuple(k for k in cfg.kernels if k == "torch" or kernel_in_use(pool) == k)
    return threads, kernels


def bench_context(
    cfg: MicroConfig, context: int, probes: dict[int, BandwidthProbe], seed: int = 0
) -> dict[str, Any]:
    """Every arm at one context length; see the module docstring for the method."""
    dtype = getattr(torch, cfg.dtype)
    length = context + cfg.response_tokens
    bs = cfg.block_size
    cache = KVCache(
        KVConfig(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, -(-length // bs) + 1, bs, dtype=dtype)
    )
    gen = torch.Generator().manual_seed(seed)
    _fill(cache, 0, length, gen)
    layout = synthetic_layout(context, cfg.chunk_tokens, cfg.sink, cfg.question_tokens)
    views = mode_views(layout, length, bs, cfg.focus_chunks)
    q = torch.randn(1, cfg.n_heads, cfg.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, cfg.n_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, cfg.n_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    scale = cfg.head_dim**-0.5
    threads, kernels = usable(cfg, cache.k[0])
    arms = [
        _Arm(kn, t, m, None if m == "global" else tuple(views[m]))
        for t in threads for kn in kernels for m in MODES
    ]

    def attention(arm: _Arm, counter: ReadCounter | None = None) -> PagedAttention:
        return PagedAttention(cache, [SeqStep(0, length - 1, 1, arm.view)], counter,
                              kernel=arm.kernel)  # type: ignore[arg-type]

    def step(arm: _Arm, counter: ReadCounter | None = None) -> None:
        attn = attention(arm, counter)
        for layer in range(cfg.n_layers):
            attn(layer, q, k, v, scale=scale, window=None)

    n_bytes: dict[str, int] = {}
    with torch.inference_mode():
        for arm in arms:  # warm-up, and what each step reads (the counter, held to the view)
            torch.set_num_threads(arm.threads)
            counter = ReadCounter()
            step(arm, counter)
            for layer in range(cfg.n_layers):
                if counter.blocks_read(0, 0, layer) != tuple(views[arm.mode]):
                    raise AssertionError(f"{arm.mode}: blocks read differ from the view")
            n_bytes[arm.mode] = counter.total_bytes()
        for _ in range(cfg.repeats):
            for t in threads:
                torch.set_num_threads(t)
                probes[t].sample()
                for arm in (a for a in arms if a.threads == t):
                    probes[t].flush()
                    t0 = time.perf_counter()
                    attention(arm)
                    t1 = time.perf_counter()
                    c1 = time.process_time()
                    step(arm)
                    c2 = time.process_time()
                    t2 = time.perf_counter()
                    arm.plans.append(t1 - t0)
                    arm.times.append(t2 - t1)  # one plan included, as in a real step
                    arm.cpu.append(c2 - c1)
    return {
        "context": context,
        "length": length,
        "n_chunks": layout.n_chunks,
        "focus_ids": list(views["focus_ids"]),
        "blocks": {m: len(views[m]) for m in MODES},
        "bytes_per_step": n_bytes,
        "arms": [
            {
                "kernel": a.kernel,
                "threads": a.threads,
                "mode": a.mode,
                "seconds_per_step": Timing.of(a.times).to_dict(),
                "cpu_seconds_per_step": Timing.of(a.cpu).to_dict(),
                "plan_seconds_per_step": Timing.of(a.plans).to_dict(),
            }
            for a in arms
        ],
    }


def compute_ceiling(cfg: MicroConfig, kernel: str, threads: int, tokens: int = 4096) -> float:
    """Bytes per second one layer call reads when its KV is hot in cache (``tokens``
    positions, 2 MiB at the default shape, no flush, best of many; the call's fixed
    costs included): what the arithmetic allows. Where this is below the DRAM
    read bandwidth, decode attention is compute-bound, and no layout of the reads gets
    a step to its bytes / bandwidth."""
    dtype = getattr(torch, cfg.dtype)
    bs = cfg.block_size
    cache = KVCache(KVConfig(1, cfg.n_kv_heads, cfg.head_dim, -(-tokens // bs), bs, dtype=dtype))
    _fill(cache, 0, tokens, torch.Generator().manual_seed(1))
    q = torch.randn(1, cfg.n_heads, cfg.head_dim).to(dtype)
    k = torch.randn(1, cfg.n_kv_heads, cfg.head_dim).to(dtype)
    attn = PagedAttention(cache, [SeqStep(0, tokens - 1, 1)], kernel=kernel)  # type: ignore[arg-type]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            best = min(
                time_call(lambda: attn(0, q, k, k, scale=1.0, window=None)) for _ in range(200)
            )
    finally:
        torch.set_num_threads(before)
    return tokens * cache.config.bytes_per_token / best


def _derive(row: dict[str, Any], read_bw: dict[int, float]) -> None:
    """Bandwidth, roofline and ratio figures of one context's arms, in place."""
    by_key = {(a["kernel"], a["threads"], a["mode"]): a for a in row["arms"]}
    full = row["bytes_per_step"]["global"]
    for a in row["arms"]:
        nb = row["bytes_per_step"][a["mode"]]
        best = a["seconds_per_step"]["best"]
        a["bytes_per_step"] = nb
        a["byte_fraction"] = nb / full
        a["read_gbps_best"] = nb / best / 1e9
        a["roofline_seconds_per_step"] = nb / read_bw[a["threads"]]
        a["time_over_roofline_best"] = best / a["roofline_seconds_per_step"]
        # CPU time leaves out waits for a core (on a loaded machine, most of the wall time);
        # per thread, so that two threads busy for the whole step count once.
        cpu = a["cpu_seconds_per_step"]["best"] / a["threads"]
        a["cpu_read_gbps_best"] = nb / cpu / 1e9
        a["cpu_time_over_roofline_best"] = cpu / a["roofline_seconds_per_step"]
        g = by_key[(a["kernel"], a["threads"], "global")]["seconds_per_step"]["best"]
        a["time_fraction_best"] = best / g
        a["time_over_bytes_best"] = a["time_fraction_best"] / a["byte_fraction"]
        one = by_key.get((a["kernel"], 1, a["mode"]))
        if one is not None:
            a["speedup_over_1_thread"] = one["seconds_per_step"]["best"] / best
        torch_arm = by_key.get(("torch", a["threads"], a["mode"]))
        if torch_arm is not None:
            a["speedup_over_torch"] = torch_arm["seconds_per_step"]["best"] / best


def run_micro(
    cfg: MicroConfig,
    probe: BandwidthProbe | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every context of ``cfg``; bandwidth is sampled in the same loop, per thread count
    (``probe``, if given, serves as the probe of the current thread count)."""
    before = torch.get_num_threads()
    probes = {t: BandwidthProbe() for t in cfg.threads}
    if probe is not None and before in probes:
        probes[before] = probe
    rows = []
    try:
        for context in cfg.contexts:
            if log is not None:
                log(f"attention micro-benchmark: context {context:,}")
            rows.append(bench_context(cfg, context, probes))
    finally:
        torch.set_num_threads(before)
    measured = {t: p.result() for t, p in probes.items() if p.reads}
    read_bw = {t: bw.read_best for t, bw in measured.items()}
    for row in rows:
        _derive(row, read_bw)
    threads = sorted({a["threads"] for r in rows for a in r["arms"]})
    kernels = sorted({a["kernel"] for r in rows for a in r["arms"]} - {"torch"})
    return {
        "config": cfg.to_dict(),
        "bandwidth": {str(t): bw.to_dict() for t, bw in measured.items()},
        "hot_cache_bytes_per_second": {
            kn: {str(t): compute_ceiling(cfg, kn, t) for t in threads} for kn in kernels
        },
        "contexts": rows,
    }
