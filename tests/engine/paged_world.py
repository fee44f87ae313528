"""A paged KV cache plus the fp64 truth of everything stored in it: the oracle that the
attention tests (``test_paged``, ``test_decode``, ``test_reads``, ``test_prefill``) share.

The reference keeps every sequence's keys and values in plain fp64 tensors and applies
a mask that keeps exactly the positions a row may see; the paged path must agree while
reading only the kept blocks out of a fragmented pool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.paged import PagedAttention
from declattn.engine.reads import ReadCounter
from declattn.engine.seq_step import SeqStep

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
TOL = 1e-5


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
    """Query rows ``q [R, H, D]`` (or one row ``[H, D]``) over ``k, v [L, Hkv, D]``,
    row ``r`` seeing the positions where ``keep [R, L]`` (or ``[L]``) is True; fp64."""
    if q.dim() == 2:
        return dense_reference(q[None], k, v, keep[None])[0]
    n_heads, n_kv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(n_heads // n_kv, dim=1)
    vv = v.double().repeat_interleave(n_heads // n_kv, dim=1)
    s = torch.einsum("rhd,lhd->rhl", q.double(), kk) * SCALE
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", torch.softmax(s, dim=-1), vv)


@dataclass
class World:
    """A paged cache plus the fp64 truth of everything stored in it."""

    cache: KVCache
    n_heads: int
    windows: tuple[int | None, ...]
    gen: torch.Generator
    truth_k: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    truth_v: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    @property
    def n_kv(self) -> int:
        return self.cache.config.n_kv_heads

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=self.cache.config.dtype)

    def step(
        self,
        rows: Sequence[tuple[int, int, Sequence[int] | None]],
        counter: ReadCounter | None = None,
        qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        rewrite_last: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[SeqStep]]:
        """Run one batch step over every layer; returns (paged out, reference out) per
        layer. ``rows``: (seq_id, n_new, view). ``rewrite_last`` re-runs the newest
        position with its stored k/v (the cache is left unchanged)."""
        steps = []
        for sid, n_new, view in rows:
            start = self.lengths.get(sid, 0) - (1 if rewrite_last else 0)
            self.cache.allocate(sid, start + n_new)
            steps.append(SeqStep(sid, start, n_new, view))
        total = sum(st.n_new for st in steps)
        attn = PagedAttention(self.cache, steps, counter)
        outs, refs = [], []
        for layer, window in enumerate(self.windows):
            q = self.rand(total, self.n_heads, HEAD_DIM)
            if qkv is not None:
                q, k, v = qkv[layer]
            elif rewrite_last:
                k = torch.cat([self.truth_k[(layer, st.seq_id)][-1:] for st in steps])
                v = torch.cat([self.truth_v[(layer, st.seq_id)][-1:] for st in steps])
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                k = self.rand(total, self.n_kv, HEAD_DIM)
                v = self.rand(total, self.n_kv, HEAD_DIM)
            outs.append(attn(layer, q, k, v, scale=SCALE, window=window))
            refs.append(self._reference(layer, window, steps, q, k, v, rewrite_last))
        if not rewrite_last:
            for st in steps:
                self.lengths[st.seq_id] = st.length
        return outs, refs, steps

    def _reference(self, layer, window, steps, q, k, v, rewrite_last) -> torch.Tensor:
        bs = self.cache.block_size
        out = torch.empty(q.shape, dtype=torch.float64)
        row = 0
        for st in steps:
            key = (layer, st.seq_id)
            old_k = self.truth_k.get(key, torch.empty(0, self.n_kv, HEAD_DIM))
            old_v = self.truth_v.get(key, torch.empty(0, self.n_kv, HEAD_DIM))
            if not rewrite_last:
                new_k = k[row : row + st.n_new].double()
                new_v = v[row : row + st.n_new].double()
                old_k = torch.cat([old_k.double(), new_k])
                old_v = torch.cat([old_v.double(), new_v])
                self.truth_k[key], self.truth_v[key] = old_k, old_v
            pos = torch.arange(st.length)[None, :]
            qpos = torch.arange(st.start, st.length)[:, None]
            keep = pos <= qpos
            if window is not None:
                keep &= pos > qpos - window
            elif st.n_new == 1 and st.view is not None:
                keep &= torch.isin(pos // bs, torch.tensor(list(st.view)))
            sl = slice(row, row + st.n_new)
            out[sl] = dense_reference(q[sl], old_k, old_v, keep)
            row += st.n_new
        return out


def make_world(
    n_heads: int,
    n_kv: int,
    windows: tuple[int | None, ...] = (None,),
    num_blocks: int = 256,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> World:
    cfg = KVConfig(
        n_layers=len(windows),
        n_kv_heads=n_kv,
        head_dim=HEAD_DIM,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    return World(KVCache(cfg), n_heads, windows, gen)


def fill_interleaved(world: World, targets: dict[int, int], seed: int = 0) -> None:
    """Prefill several sequences in random interleaved chunks so that their block
    tables are fragmented (not physically consecutive)."""
    rng = random.Random(seed)
    while any(world.lengths.get(s, 0) < n for s, n in targets.items()):
        rows = []
        for sid, n in targets.items():
            have = world.lengths.get(sid, 0)
            if have < n:
                rows.append((sid, min(n - have, rng.randrange(2, 9)), None))
        rng.shuffle(rows)
        outs, refs, _ = world.step(rows)
        for o, r in zip(outs, refs, strict=True):
            assert torch.allclose(o.double(), r, atol=TOL, rtol=0)


def n_runs(table: Sequence[int]) -> int:
    return 1 + sum(1 for a, b in zip(table, table[1:], strict=False) if b != a + 1)


def random_view(rng: random.Random, length: int, bs: int) -> list[int]:
    n_blocks = -(-length // bs)
    kept = {b for b in range(n_blocks - 1) if rng.random() < 0.4}
    return sorted(kept | {n_blocks - 1})


GQA = [(4, 4), (4, 2), (8, 2)]


def force_kernel(monkeypatch, kernel: str) -> None:
    """Make every decode row take ``kernel`` (the fused kernel or the torch fallback).

    The fused kernel must build on a machine with a C++ compiler; only an explicit
    ``DECLATTN_DECODE_KERNEL=torch`` turns its tests into skips."""
    import os

    import pytest

    from declattn.engine import decode
    from declattn.engine.native import ENV_SWITCH, decode_op

    if kernel == "native" and decode_op() is None:
        if os.environ.get(ENV_SWITCH) == "torch":
            pytest.skip(f"{ENV_SWITCH}=torch")
        pytest.fail("the fused decode kernel did not build (see the warning)")
    monkeypatch.setattr(decode, "kernel_in_use", lambda pool: kernel)
