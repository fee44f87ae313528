"""Blocks as sequences grow, and preemption when the pool runs out: the sequence holding
the most blocks gives them back and resumes by recompute, under the views it decoded
with, so its tokens are what they would have been without the preemption (fp32)."""

from __future__ import annotations

import pytest
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.engine import PagedEngine
from declattn.engine.kv import PoolExhausted
from declattn.engine.sampler import SamplingParams


class Narrow(Controller):
    """A DA-like controller: after a few tokens it reads the first and newest blocks."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(ids)
        self.steps = 0

    def view(self, length: int) -> list[int] | None:
        self.steps += 1
        if self.steps < 4:
            return None
        return sorted({0, (length - 1) // 16})


def engine(model, num_blocks: int) -> PagedEngine:
    return PagedEngine(model, Tok(), num_blocks=num_blocks, block_size=16, prefill_chunk=64)


def run_all(eng: PagedEngine, ctls: list[Controller], n: int) -> list:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    seqs = [eng.add(c, params) for c in ctls]
    while eng.has_work:
        eng.step()
    return seqs


@pytest.mark.parametrize("cls", [Controller, Narrow])
def test_preempted_sequences_give_the_tokens_they_give_unpreempted(cls) -> None:
    model = tiny_model(seed=11)
    prompts = [prompt(60 + 7 * i, 30 + i) for i in range(3)]
    alone = [run_all(engine(model, 64), [cls(p)], 60)[0].output_ids for p in prompts]
    # 14 blocks: each sequence ends at ~8-9 blocks, so three at once cannot all fit
    seqs = run_all(engine(model, 14), [cls(p) for p in prompts], 60)
    assert sum(s.preemptions for s in seqs) > 0
    assert [s.output_ids for s in seqs] == alone
    assert all(len(s.reads) == 59 for s in seqs)  # one read per decode step, recompute aside


def test_a_waiting_prefill_waits_for_room_instead_of_failing() -> None:
    model = tiny_model(seed=12)
    eng = engine(model, 12)
    big = eng.add(Controller(prompt(120, 1)), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.step()  # big is prefilled: 8 blocks held
    late = eng.add(Controller(prompt(100, 2)), SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert big.finish_reason == late.finish_reason == "length"
    assert eng.cache.blocks_in_use == 0


def test_a_lone_sequence_larger_than_the_pool_is_a_clear_error() -> None:
    eng = engine(tiny_model(seed=13), 4)
    eng.add(Controller(prompt(40, 3)), SamplingParams(max_tokens=60, ignore_eos=True))
    with pytest.raises(PoolExhausted, match="blocks needed"):
        while eng.has_work:
            eng.step()
