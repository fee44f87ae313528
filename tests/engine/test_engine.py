"""The decode loop: paged decode equals a dense recompute; batching changes nothing;
sampling and stopping rules; a full pool is a clear error that corrupts nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.dense import DenseAttention
from declattn.engine.engine import PagedEngine
from declattn.engine.kv import PoolExhausted
from declattn.engine.models import Decoder
from declattn.engine.sampler import SamplingParams


def dense_greedy(model: Decoder, prompt: list[int], n: int) -> list[int]:
    attn = DenseAttention()
    ids = torch.tensor(prompt)
    with torch.no_grad():
        h = model(ids, torch.arange(len(prompt)), attn)
        out = [int(model.logits(h[-1:])[0].argmax())]
        for _ in range(n - 1):
            pos = torch.tensor([len(prompt) + len(out) - 1])
            h = model(torch.tensor(out[-1:]), pos, attn)
            out.append(int(model.logits(h)[0].argmax()))
    return out


def make_engine(model: Decoder, num_blocks: int = 256, prefill_chunk: int = 64) -> PagedEngine:
    return PagedEngine(model, Tok(), num_blocks=num_blocks, block_size=16,
                       prefill_chunk=prefill_chunk, prefix_caching=prefill_chunk % 16 == 0)


def run_one(engine: PagedEngine, ids: list[int], params: SamplingParams, controller=None):
    seq = engine.add(controller or Controller(ids), params)
    for _ in engine.run(seq):
        pass
    return seq


def test_paged_greedy_equals_dense_recompute():
    model = tiny_model()
    ids = prompt(150, 1)  # several prefill chunks, a length not a multiple of the block
    seq = run_one(make_engine(model), ids, SamplingParams(max_tokens=24, ignore_eos=True))
    assert seq.output_ids == dense_greedy(model, ids, 24)
    assert seq.finish_reason == "length"


def test_batch_gives_the_same_tokens_as_one_at_a_time():
    model = tiny_model(seed=3)
    prompts = [prompt(n, s) for n, s in ((40, 1), (97, 2), (16, 3), (130, 4))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [run_one(make_engine(model), p, params).output_ids for p in prompts]
    engine = make_engine(model)
    seqs = [engine.add(Controller(p), params) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == alone
    assert engine.cache.blocks_in_use == 0  # finished sequences gave their blocks back


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = tiny_model(seed=5)
    ids = prompt(50, 9)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    a = run_one(make_engine(model), ids, params).output_ids
    engine = make_engine(model)
    hot = SamplingParams(temperature=1.0, seed=9, max_tokens=16)
    other = engine.add(Controller(prompt(70, 2)), hot)
    mine = engine.add(Controller(ids), params)
    while engine.has_work:
        engine.step()
    assert mine.output_ids == a
    assert other.output_ids != a
    greedy = run_one(make_engine(model), ids, SamplingParams(max_tokens=16, ignore_eos=True))
    assert greedy.output_ids != a  # temperature 1 with this seed is not greedy


def test_stop_string_truncates_and_finishes():
    model = tiny_model()
    ids = prompt(30, 4)
    full = run_one(make_engine(model), ids, SamplingParams(max_tokens=10, ignore_eos=True))
    stop = full.text[5:7]
    seq = run_one(make_engine(model), ids, SamplingParams(max_tokens=10, stop=(stop,)))
    assert seq.finish_reason == "stop"
    assert seq.text == full.text[: full.text.index(stop)]


def test_eos_finishes():
    model = tiny_model()
    ids = prompt(30, 4)
    full = run_one(make_engine(model), ids, SamplingParams(max_tokens=10, ignore_eos=True))
    engine = make_engine(model)
    engine.acceptor.eos = {full.output_ids[3]}
    seq = run_one(engine, ids, SamplingParams(max_tokens=10))
    assert seq.finish_reason == "eos"
    assert seq.output_ids == full.output_ids[: full.output_ids.index(full.output_ids[3]) + 1]


def test_view_restricts_what_decode_reads_and_counter_proves_it():
    model = tiny_model()
    ids = prompt(200, 2)

    class Narrow(Controller):
        def __init__(self):
            super().__init__(ids)
            self.views = []

        def view(self, length):
            last = (length - 1) // 16
            v = sorted({0, 3, 4, last})
            self.views.append(tuple(v))
            return v

    ctl = Narrow()
    seq = run_one(make_engine(model), ids, SamplingParams(max_tokens=8, ignore_eos=True), ctl)
    assert [r.blocks for r in seq.reads] == ctl.views
    assert all(r.layers_agree for r in seq.reads)
    full = run_one(make_engine(model), ids, SamplingParams(max_tokens=8, ignore_eos=True))
    assert seq.output_ids[0] == full.output_ids[0]  # token 0 comes from the full prefill
    assert sum(r.global_bytes for r in seq.reads) < 0.35 * sum(r.global_bytes for r in full.reads)


def test_pool_exhaustion_is_clear_and_corrupts_nothing():
    model = tiny_model()
    engine = make_engine(model, num_blocks=8)  # 128 positions
    four = SamplingParams(max_tokens=4, ignore_eos=True)
    small = engine.add(Controller(prompt(40, 1)), four)
    big = engine.add(Controller(prompt(200, 2)), four)
    engine.step()  # prefill `small`
    with pytest.raises(PoolExhausted, match="blocks needed"):
        while big in engine.waiting:
            engine.step()
    engine.abort(big)
    for _ in engine.run(small):
        pass
    expected = run_one(make_engine(model), small.prompt_ids, small.params).output_ids
    assert small.output_ids == expected
    assert engine.cache.blocks_in_use == 0


def test_prompt_longer_than_the_model_is_refused():
    engine = make_engine(tiny_model())
    with pytest.raises(ValueError, match="exceeds"):
        engine.add(Controller(prompt(4000, 1)), SamplingParams(max_tokens=200))


def test_synthetic_prefill_leaves_the_last_token_to_the_model():
    model = tiny_model()
    ids = prompt(100, 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = make_engine(model)
    seq = engine.add(Controller(ids), params)
    engine.prefill_synthetic(seq, generator=torch.Generator().manual_seed(0))
    assert seq.prefilled == 99 and seq in engine.waiting
    rows = engine.cache.slots(seq.seq_id, 0, 99)
    assert all(bool(pool[:, rows].abs().sum(-1).gt(0).all()) for pool in engine.cache.k)
    with pytest.raises(ValueError, match="nothing prefilled"):
        engine.prefill_synthetic(seq)
    events = engine.step()  # one real prefill step: the last prompt token
    assert [e.index for e in events] == [0] and seq in engine.running
    for _ in engine.run(seq):
        pass
    assert len(seq.output_ids) == 6 and len(seq.reads) == 5
    assert all(r.length == 100 + i for i, r in enumerate(seq.reads, start=1))
    # Nothing synthetic (upto=0) is an ordinary prefill: the same tokens as without it.
    plain = run_one(make_engine(model), ids, params)
    other = make_engine(model)
    seq0 = other.add(Controller(ids), params)
    other.prefill_synthetic(seq0, upto=0)
    for _ in other.run(seq0):
        pass
    assert seq0.output_ids == plain.output_ids


@pytest.mark.parametrize("chunk", [7, 64, 2048])
def test_prefill_chunk_size_does_not_change_tokens(chunk):
    model = tiny_model(seed=2)
    ids = prompt(150, 5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seq = run_one(make_engine(model, prefill_chunk=chunk), ids, params)
    assert seq.output_ids == dense_greedy(model, ids, 8)


def test_sampling_survives_underflowing_parameters():
    from declattn.engine.sampler import sample

    logits = torch.tensor([1.0, 3.0, 2.0])
    tiny_p = SamplingParams(temperature=1.0, top_p=5e-324, seed=1)
    assert sample(logits, tiny_p, tiny_p.generator()) == 1
    tiny_t = SamplingParams(temperature=1e-30)
    assert sample(logits, tiny_t, tiny_t.generator()) == 1


@pytest.mark.parametrize("stagger", [None, 2])
def test_batch_invariant_mode_gives_each_sequence_its_logits_alone_bit_for_bit(stagger):
    """With ``batch_invariant`` a batched decode step is one model call per sequence, so
    every sequence's logits are exactly those it gets alone (a batched matmul may pick
    its kernel, and so its rounding, by the number of rows). ``stagger``: sequences
    arrive while others decode and finish, so their blocks interleave and freed blocks
    are reused below a running sequence's earlier ones; attention still sums its rows
    in logical order, so placement changes nothing either."""
    model = tiny_model(seed=5)
    shape = ((33, 1), (70, 2), (18, 3)) if stagger is None else (
        (30, 1), (14, 2), (45, 3), (29, 4), (61, 5), (12, 6), (40, 7))
    prompts = [prompt(n, s) for n, s in shape]
    params = SamplingParams(max_tokens=6 if stagger is None else 24, ignore_eos=True)

    def logits_of(engine: PagedEngine, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        seen: list[list[torch.Tensor]] = [[] for _ in batch]

        class Recorder(Controller):
            def __init__(self, ids: list[int], row: int) -> None:
                super().__init__(ids)
                self.row = row

            def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
                seen[self.row].append(logits.clone())
                return logits

        for row, ids in enumerate(batch):
            engine.add(Recorder(ids, row), params)
            for _ in range(stagger or 0):
                engine.step()
        while engine.has_work:
            engine.step()
        return seen

    def invariant() -> PagedEngine:
        return PagedEngine(model, Tok(), num_blocks=256, block_size=16, prefill_chunk=64,
                           batch_invariant=True)

    alone = [logits_of(invariant(), [p])[0] for p in prompts]
    together = logits_of(invariant(), prompts)
    for solo, batched in zip(alone, together, strict=True):
        assert len(solo) == len(batched) == params.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(solo, batched, strict=True))


def test_decode_seconds_hold_the_controllers_time_too():
    """A reply's decode seconds are what its user waits for: the forwards and the time
    the controller takes over each token (a DA state, its constraints)."""
    import time

    class Slow(Controller):
        def process_logits(self, logits):
            time.sleep(0.02)
            return logits

    model = tiny_model()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    seq = run_one(make_engine(model), prompt(40, 1), params, Slow(prompt(40, 1)))
    assert seq.decode_seconds >= 5 * 0.02  # five decode steps, each sampled by Slow
    assert seq.prefill_seconds >= 0.02  # the first token, from the prefill's logits
