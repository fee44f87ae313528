"""Mixed steps: one forward carries every running sequence's decode row and a piece of a
waiting prompt (fp32, tiny model).

- running sequences decode every step while a prompt prefills beside them, and each
  sequence's greedy tokens are what it gives alone;
- each decode row of a mixed step reads its own view (read counter == view, row by row);
- preemption and prefix caching keep working: a prefix cached by a prompt prefilled
  beside decode rows gives bit for bit a fresh prefill's logits;
- ``prefill_budget`` cuts pieces at fixed places inside a chunk, so the same holds;
- ``prefill_first`` keeps the older rule (a step is a piece or decode rows, never both).
"""

from __future__ import annotations

import pytest
import torch
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller, Forced
from declattn.engine.engine import PagedEngine
from declattn.engine.sampler import SamplingParams

BS = 16


def engine(model, num_blocks: int = 256, **kw) -> PagedEngine:
    kw.setdefault("prefill_chunk", 64)
    return PagedEngine(model, Tok(), num_blocks=num_blocks, block_size=BS, **kw)


class Narrow(Controller):
    """After two tokens, the first and newest blocks; keeps every view asked for."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(ids)
        self.views: list[tuple[int, ...] | None] = []

    def view(self, length: int):
        view = None if len(self.views) < 2 else tuple(sorted({0, (length - 1) // BS}))
        self.views.append(view)
        return view


def alone(model, ctl: Controller, n: int, **kw) -> list[int]:
    eng = engine(model, **kw)
    seq = eng.add(ctl, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in eng.run(seq):
        pass
    return seq.output_ids


def test_streams_decode_every_step_while_a_prompt_prefills() -> None:
    model = tiny_model(seed=31)
    short = [prompt(30 + 9 * i, 40 + i) for i in range(3)]
    long = prompt(600, 50)  # pieces of 64 rows at first, fewer further in (row_cost.py)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = engine(model)
    streams = [eng.add(Narrow(p), params) for p in short]
    for _ in range(3):
        eng.step()  # the three prompts: one piece each
    late = eng.add(Narrow(long), SamplingParams(max_tokens=6, ignore_eos=True))
    mixed = 0
    while late in eng.waiting:
        batch = eng.next_batch()
        events = eng.step()
        assert {e.seq_id for e in events} >= {s.seq_id for s in streams if not s.finish_reason}
        mixed += late in batch and any(s in batch for s in streams)
    pieces, start = 0, 0
    while start < len(long):
        start, pieces = eng.scheduler.piece_stop(start, len(long)), pieces + 1
    assert pieces > 10 and mixed == pieces  # every piece of the long prompt beside the streams
    while eng.has_work:
        eng.step()
    for seq in [*streams, late]:
        n = len(seq.output_ids)
        assert seq.output_ids == alone(model, Narrow(seq.prompt_ids), n)
        assert [r.blocks for r in seq.reads] == [
            v if v is not None else tuple(range(-(-r.length // BS)))
            for v, r in zip(seq.controller.views, seq.reads, strict=True)
        ]
    assert eng.cache.blocks_in_use == 0


def test_prefill_first_runs_a_piece_alone() -> None:
    model = tiny_model(seed=32)
    eng = engine(model, prefill_first=True)
    a = eng.add(Controller(prompt(40, 1)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    b = eng.add(Controller(prompt(200, 2)), SamplingParams(max_tokens=4, ignore_eos=True))
    stalled = 0
    while b in eng.waiting:
        assert eng.next_batch() == [b]
        stalled += not any(e.seq_id == a.seq_id for e in eng.step())
    pieces, start = 0, 0
    while start < 200:
        start, pieces = eng.scheduler.piece_stop(start, 200), pieces + 1
    assert stalled == pieces > 4  # a waited the whole prefill, piece after piece
    while eng.has_work:
        eng.step()
    assert a.output_ids == alone(model, Controller(a.prompt_ids), 20)


def test_a_prefix_cached_beside_decode_rows_gives_a_fresh_prefills_logits() -> None:
    model = tiny_model(seed=33)
    doc = prompt(300, 3)
    q1, q2 = doc + prompt(20, 4), doc + prompt(25, 5)
    fresh = Forced(Narrow(q2), [], keep_logits=True)
    ref = alone(model, fresh, 6, prefix_caching=False)
    eng = engine(model)
    stream = eng.add(Narrow(prompt(50, 6)), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    first = eng.add(Controller(q1), SamplingParams(max_tokens=2, ignore_eos=True))
    while first.finish_reason is None:
        assert stream in eng.next_batch()
        eng.step()
    assert stream.finish_reason is None  # q1 was prefilled beside the stream's decode rows
    eng.abort(stream)  # q2 alone: its own last piece is a call of its own, as in `fresh`
    cached = Forced(Narrow(q2), [], keep_logits=True)
    second = eng.add(cached, SamplingParams(max_tokens=6, ignore_eos=True))
    assert second.cached_tokens == 256
    for _ in eng.run(second):
        pass
    assert torch.equal(cached.logits[0], fresh.logits[0])  # the prefill: bit for bit
    assert second.output_ids == ref


@pytest.mark.parametrize("budget", [16, 24])  # at most MIN_PIECE: never scaled down
def test_a_budget_below_the_chunk_cuts_pieces_at_fixed_places(budget: int) -> None:
    model = tiny_model(seed=34)
    eng = engine(model, prefill_budget=budget)
    assert eng.prefill_budget == budget
    cuts, start = [], 0
    while start < 200:
        start = eng.scheduler.piece_stop(start, 200)
        cuts.append(start)
    expected = {16: [*range(16, 200, 16), 200],
                24: [24, 48, 64, 88, 112, 128, 152, 176, 192, 200]}
    assert cuts == expected[budget]  # never across a multiple of the chunk
    doc = prompt(300, 7)
    q1, q2 = doc + prompt(20, 8), doc + prompt(25, 9)
    fresh = Forced(Controller(q2), [], keep_logits=True)
    alone(model, fresh, 2, prefix_caching=False, prefill_budget=budget)
    stream = eng.add(Controller(prompt(40, 10)), SamplingParams(max_tokens=60, ignore_eos=True))
    eng.step()
    first = eng.add(Controller(q1), SamplingParams(max_tokens=1, ignore_eos=True))
    while first.finish_reason is None:
        eng.step()
    assert stream.finish_reason is None
    eng.abort(stream)
    cached = Forced(Controller(q2), [], keep_logits=True)
    second = eng.add(cached, SamplingParams(max_tokens=2, ignore_eos=True))
    assert second.cached_tokens == 256
    for _ in eng.run(second):
        pass
    assert torch.equal(cached.logits[0], fresh.logits[0])


@pytest.mark.parametrize("prefill_first", [False, True])
def test_preemption_under_mixed_steps(prefill_first: bool) -> None:
    """Sequences arrive while others decode, in a pool too small for all: the ones
    preempted resume by recompute beside running decode rows, with the tokens and the
    reads they give alone."""
    model = tiny_model(seed=35)
    prompts = [prompt(60 + 11 * i, 60 + i) for i in range(4)]
    solo = [alone(model, Narrow(p), 50) for p in prompts]
    eng = engine(model, num_blocks=18, prefill_first=prefill_first)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    seqs = []
    for p in prompts:
        seqs.append(eng.add(Narrow(p), params))
        for _ in range(5):
            eng.step()
    while eng.has_work:
        eng.step()
    assert sum(s.preemptions for s in seqs) > 0
    assert [s.output_ids for s in seqs] == solo
    assert all(len(s.reads) == 49 for s in seqs)
    assert eng.cache.blocks_in_use == 0
