"""Decode attention alone: time per step against the bytes each mode must read.

One decode row attends a synthetic KV cache through the engine's own path
(``PagedAttention`` over a ``KVCache``, views from ``Scope``), in a KV-heavy layer shape.
The three modes are interleaved in one loop with a bandwidth probe, and the caches are
flushed before every step, as a real step's weight reads would flush them, so a small
view cannot win by sitting in L3. The figure of merit is the time fraction of a mode
against global over its kept-byte fraction: 1.0 means reading fewer blocks saves time
exactly in proportion to the bytes. Process CPU time is recorded beside wall time: on a
machine shared with busy neighbours it is the steadier of the two (it leaves out the
time this process waited for a core), though it still pays for shared memory bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from declattn.bench.machine import BandwidthProbe, Timing
from declattn.engine.attention import PagedAttention, ReadCounter, SeqStep
from declattn.engine.kv import KVCache, KVConfig
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode
from declattn.scope import Scope

MODES = ("global", "focus", "local")


@dataclass(frozen=True)
class MicroConfig:
    """Shape and schedule of the micro-benchmark.

    ``n_layers`` separate pools are read per step (a step of a model with that many
    global layers); times are reported per layer.
    """

    contexts: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    n_layers: int = 4
    chunk_tokens: int = 2048
    focus_chunks: int = 2
    sink: int = 16
    question_tokens: int = 64
    response_tokens: int = 32
    repeats: int = 7
    dtype: str = "bfloat16"

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
    view: tuple[int, ...] | None
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    plans: list[float] = field(default_factory=list)
    bytes_per_layer: int = 0
    blocks: int = 0


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


def bench_context(
    cfg: MicroConfig, context: int, probe: BandwidthProbe, seed: int = 0
) -> dict[str, Any]:
    """All modes at one context length; see the module docstring for the method."""
    dtype = getattr(torch, cfg.dtype)
    length = context + cfg.response_tokens
    bs = cfg.block_size
    n_blocks = -(-length // bs) + 1
    cache = KVCache(
        KVConfig(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, bs, dtype=dtype)
    )
    gen = torch.Generator().manual_seed(seed)
    _fill(cache, 0, length, gen)
    layout = synthetic_layout(context, cfg.chunk_tokens, cfg.sink, cfg.question_tokens)
    views = mode_views(layout, length, bs, cfg.focus_chunks)
    q = torch.randn(1, cfg.n_heads, cfg.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, cfg.n_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, cfg.n_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    scale = cfg.head_dim**-0.5
    arms = {m: _Arm(None if m == "global" else tuple(views[m])) for m in MODES}

    def step(arm: _Arm, counter: ReadCounter | None) -> Callable[[], None]:
        def run() -> None:
            attn = PagedAttention(cache, [SeqStep(0, length - 1, 1, arm.view)], counter)
            for layer in range(cfg.n_layers):
                attn(layer, q, k, v, scale=scale, window=None)

        return run

    with torch.inference_mode():
        for name, arm in arms.items():  # warm-up, and what each step reads
            counter = ReadCounter()
            step(arm, counter)()
            want = views[name]
            for layer in range(cfg.n_layers):
                if counter.blocks_read(0, 0, layer) != tuple(want):
                    raise AssertionError(f"{name}: blocks read differ from the view")
            arm.bytes_per_layer = counter.total_bytes() // cfg.n_layers
            arm.blocks = len(want)
        for _ in range(cfg.repeats):
            probe.sample()
            for arm in arms.values():
                probe.flush()
                t0 = time.perf_counter()
                PagedAttention(cache, [SeqStep(0, length - 1, 1, arm.view)])
                t1 = time.perf_counter()
                c1 = time.process_time()
                step(arm, None)()
                c2 = time.process_time()
                t2 = time.perf_counter()
                arm.plans.append(t1 - t0)
                arm.times.append((t2 - t1) / cfg.n_layers)  # one plan included
                arm.cpu.append((c2 - c1) / cfg.n_layers)
    out: dict[str, Any] = {
        "context": context,
        "length": length,
        "n_chunks": layout.n_chunks,
        "focus_ids": list(views["focus_ids"]),
        "modes": {},
    }
    g = arms["global"]
    g_time, g_cpu = Timing.of(g.times), Timing.of(g.cpu)
    for name, arm in arms.items():
        t, c = Timing.of(arm.times), Timing.of(arm.cpu)
        entry: dict[str, Any] = {
            "blocks": arm.blocks,
            "bytes_per_layer": arm.bytes_per_layer,
            "seconds_per_layer": t.to_dict(),
            "cpu_seconds_per_layer": c.to_dict(),
            "cpu_time_over_bytes_best": c.best / g_cpu.best / (
                arm.bytes_per_layer / g.bytes_per_layer
            ),
            "plan_seconds_per_step": Timing.of(arm.plans).to_dict(),
            "byte_fraction": arm.bytes_per_layer / g.bytes_per_layer,
            "time_fraction_best": t.best / g_time.best,
            "time_fraction_median": t.median / g_time.median,
        }
        entry["time_over_bytes_best"] = entry["time_fraction_best"] / entry["byte_fraction"]
        entry["time_over_bytes_median"] = entry["time_fraction_median"] / entry["byte_fraction"]
        entry["read_gbps_best"] = arm.bytes_per_layer / t.best / 1e9
        out["modes"][name] = entry
    return out


def run_micro(
    cfg: MicroConfig, probe: BandwidthProbe | None = None, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every context of ``cfg``; the bandwidth probe is sampled in the same loop."""
    probe = probe or BandwidthProbe()
    rows = []
    for context in cfg.contexts:
        if log is not None:
            log(f"attention micro-benchmark: context {context:,}")
        rows.append(bench_context(cfg, context, probe))
    bw = probe.result()
    for row in rows:
        for entry in row["modes"].values():
            entry["roofline_seconds_per_layer"] = entry["bytes_per_layer"] / bw.read_best
            entry["fraction_of_read_bandwidth"] = (
                entry["roofline_seconds_per_layer"] / entry["seconds_per_layer"]["best"]
            )
    return {"config": cfg.to_dict(), "bandwidth": bw.to_dict(), "contexts": rows}
