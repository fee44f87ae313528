"""Prefix caching in the engine: a prompt that starts like an earlier one takes over its
K/V, and nothing it computes changes.

- the first token's logits are bit for bit a fresh prefill's (fp32), plain and DA;
- sequences sharing a prefix at the same time give what each gives alone;
- eviction under a small pool never frees a block in use;
- the read accounting is untouched: a read of a shared block is a read.
"""

from __future__ import annotations

import torch
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller, Forced
from declattn.engine.engine import PagedEngine
from declattn.engine.sampler import SamplingParams

CHUNK = 64  # prefill chunk: sharing stops at a multiple of it


def engine(model, num_blocks: int = 256, caching: bool = True) -> PagedEngine:
    return PagedEngine(
        model, Tok(), num_blocks=num_blocks, block_size=16, prefill_chunk=CHUNK,
        prefix_caching=caching,
    )


def run(eng: PagedEngine, ctl: Controller, n: int = 6):
    keep = Forced(ctl, [], keep_logits=True)
    seq = eng.add(keep, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in eng.run(seq):
        pass
    return seq, keep.logits


class Narrow(Controller):
    """A DA-like view: the first and last blocks only."""

    def view(self, length: int) -> list[int]:
        last = (length - 1) // 16
        return sorted({0, last})


def test_a_cached_prefix_gives_a_fresh_prefills_logits() -> None:
    model = tiny_model(seed=4)
    doc = prompt(300, 1)
    q1, q2 = doc + prompt(20, 2), doc + prompt(25, 3)
    for cls in (Controller, Narrow):
        fresh = engine(model, caching=False)
        ref_seq, ref = run(fresh, cls(q2))
        cached = engine(model)
        first, _ = run(cached, cls(q1))
        assert first.cached_tokens == 0
        seq, logits = run(cached, cls(q2))
        assert seq.cached_tokens == 256  # (len - 1) rounded down to whole prefill chunks
        assert torch.equal(logits[0], ref[0])  # the prefill: bit for bit
        assert seq.output_ids == ref_seq.output_ids
        assert [r.blocks for r in seq.reads] == [r.blocks for r in ref_seq.reads]
        assert [r.global_bytes for r in seq.reads] == [r.global_bytes for r in ref_seq.reads]


def test_sharing_at_the_same_time_gives_what_each_gives_alone() -> None:
    model = tiny_model(seed=6)
    doc = prompt(200, 5)
    prompts = [doc + prompt(10 + i, 10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = [run(engine(model, caching=False), Controller(p), 8)[0].output_ids for p in prompts]
    eng = engine(model)
    run(eng, Controller(prompts[0]), 1)  # caches the document
    seqs = [eng.add(Controller(p), params) for p in prompts]
    assert all(s.cached_tokens == 192 for s in seqs)
    shared = set(eng.cache.block_table(seqs[0].seq_id)[:12])
    assert all(set(eng.cache.block_table(s.seq_id)[:12]) == shared for s in seqs)
    while eng.has_work:
        eng.step()
    assert [s.output_ids for s in seqs] == alone
    assert eng.cache.blocks_in_use == 0 and eng.cache.blocks.n_cached_idle > 0


def test_eviction_under_a_small_pool_never_frees_a_block_in_use() -> None:
    model = tiny_model(seed=8)
    doc = prompt(260, 7)
    long_one = doc + prompt(10, 8)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = run(engine(model, caching=False), Controller(long_one), 30)[0].output_ids
    eng = engine(model, num_blocks=40)  # 640 positions
    run(eng, Controller(doc + prompt(5, 9)), 1)  # the document's blocks are now cached
    holder = eng.add(Controller(long_one), params)  # shares 256 cached positions
    assert holder.cached_tokens == 256
    table = eng.cache.block_table(holder.seq_id)
    for _ in range(3):
        eng.step()
    # Other prompts churn through the rest of the pool, evicting whatever idles.
    for s in range(3):
        other = eng.add(Controller(prompt(150, 20 + s)), SamplingParams(max_tokens=2))
        while other.finish_reason is None:
            eng.step()
        assert not set(eng.cache.block_table(other.seq_id)) & set(table)
    for _ in eng.run(holder):
        pass
    assert holder.output_ids == expected
    assert eng.cache.blocks_in_use == 0


def test_noise_is_never_cached() -> None:
    model = tiny_model(seed=1)
    ids = prompt(200, 3)
    eng = engine(model)
    seq = eng.add(Controller(ids), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.prefill_synthetic(seq, generator=torch.Generator().manual_seed(0))
    for _ in eng.run(seq):
        pass
    again = eng.add(Controller(ids), SamplingParams(max_tokens=1))
    assert again.cached_tokens == 0 and eng.cache.blocks.n_cached == 0
