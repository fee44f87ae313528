"""The training mask is what the engine reads: row by row, and logit by logit."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from declattn.api.session import DASession
from declattn.engine.engine import PagedEngine
from declattn.engine.sampler import SamplingParams
from declattn.protocol.layout import Layout, Span
from declattn.train.data import da_tiny_options, encode
from declattn.train.mask import transcript_mask
from declattn.train.tasks import make_episode
from declattn.train.trainer import collate, hidden_states


class Forced(DASession):
    """A DA session whose engine run follows a given transcript (teacher forcing) and
    keeps the logits of every step."""

    def __init__(self, *args: Any, forced: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script, self.logits = forced, []

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.clone())
        out = torch.full_like(logits, float("-inf"))
        out[self.script[self.n_tokens]] = 0.0
        return out


def _engine_run(model: Any, tok: Any, episode: Any) -> tuple[Forced, Any]:
    o = da_tiny_options()
    forced = tok.encode(episode.target, add_special_tokens=False)
    sess = Forced(tok, episode.context, episode.question, o, 16, forced=forced)
    engine = PagedEngine(model, tok, num_blocks=256, block_size=16)
    seq = engine.add(sess, SamplingParams(max_tokens=len(forced)))
    while seq.finish_reason is None:
        engine.step()
    return sess, seq


@pytest.mark.parametrize("two_hop", [False, True])
def test_mask_rows_are_the_blocks_the_engine_read(tiny_tok, random_tiny, two_hop) -> None:
    episode = make_episode(random.Random(5), 12, two_hop)
    ex = encode(tiny_tok, episode, da_tiny_options())
    sess, seq = _engine_run(random_tiny, tiny_tok, episode)
    assert sess.prompt_ids == ex.input_ids[: ex.layout.prompt_len]
    assert len(seq.reads) == len(ex.output_texts) - 1  # one read per decode step
    narrowed = 0
    for read in seq.reads:
        row = read.length - 1
        seen = torch.zeros(len(ex.input_ids), dtype=torch.bool)
        for b in read.blocks:
            seen[b * 16 : min((b + 1) * 16, read.length)] = True
        assert torch.equal(ex.mask[row], seen), f"row {row} (output {read.index})"
        narrowed += int(seen.sum()) < read.length
    assert narrowed >= 5  # the transcript really narrows: focus and answer steps


def test_training_logits_equal_the_engines_decode_logits(tiny_tok, random_tiny) -> None:
    episode = make_episode(random.Random(9), 10, True)
    ex = encode(tiny_tok, episode, da_tiny_options())
    sess, _ = _engine_run(random_tiny, tiny_tok, episode)
    batch = collate([ex], tiny_tok.pad_token_id)
    with torch.no_grad():
        hidden = hidden_states(random_tiny, batch)
        rows = random_tiny.logits(hidden[ex.layout.prompt_len - 1 :])
    engine = torch.stack(sess.logits)
    assert rows.shape == engine.shape
    torch.testing.assert_close(rows, engine, atol=1e-4, rtol=1e-4)


def _layout() -> Layout:
    return Layout(
        prompt_len=40, sink=Span(0, 4), chunks=(Span(8, 20), Span(20, 32)),
        question=Span(34, 40),
    )


def test_prompt_rows_are_causal_and_unmasked_transcripts_are_fully_causal() -> None:
    texts = ['<focus magic_chunks="', "2", '">', "x", "</focus>"]
    masked = transcript_mask(_layout(), texts, block_size=1)
    plain = transcript_mask(_layout(), texts, block_size=1, masking=False)
    causal = torch.ones(44, 44, dtype=torch.bool).tril()
    assert torch.equal(plain, causal)
    assert torch.equal(masked[:40], causal[:40])
    # decode step 3 (row 42) reads in focus on chunk 2: sink, chunk 2, question, response
    want = torch.zeros(44, dtype=torch.bool)
    for a, b in ((0, 4), (20, 32), (34, 43)):
        want[a:b] = True
    assert torch.equal(masked[42], want)


def test_chunk_local_confines_chunk_rows_to_sink_and_own_chunk() -> None:
    mask = transcript_mask(_layout(), ["a", "b"], block_size=1, chunk_local=True)
    row = mask[25]  # inside chunk 2
    assert row[:4].all() and not row[4:20].any() and row[20:26].all() and not row[26:].any()
    assert mask[36, :37].all()  # question rows stay causal


def test_an_empty_transcript_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one output token"):
        transcript_mask(_layout(), [])


def test_padding_changes_no_sequence_of_a_batch(tiny_tok, random_tiny) -> None:
    rng = random.Random(2)
    short = encode(tiny_tok, make_episode(rng, 3, False), da_tiny_options())
    long = encode(tiny_tok, make_episode(rng, 9, True), da_tiny_options())
    with torch.no_grad():
        alone = hidden_states(random_tiny, collate([short], 1))
        both = hidden_states(random_tiny, collate([short, long], 1))
    torch.testing.assert_close(both[: len(short.input_ids)], alone, atol=1e-5, rtol=1e-5)


def test_mask_rows_follow_the_economy_protocol_row_by_row(random_smol_model) -> None:
    """A find focus with the answer inside it, under the scaffold rule: every decode
    row of the training mask is the blocks the engine read for that token."""
    from harbour import CONTEXT, QUESTION

    from declattn.api import Engine
    from declattn.da.options import DAOptions
    from declattn.engine.controller import Forced as Teacher
    from declattn.protocol.modes import Mode

    engine = Engine(random_smol_model, kv_tokens=8192)
    options = DAOptions.economy(target=96, cap=128, jump_forward=False, min_context=0)
    sess = engine.session(CONTEXT, QUESTION, options=options)
    tok = engine.tokenizer
    forced = tok.encode('<focus find="day 5 notes calm water, 15 boats"><answer>15</answer>',
                        add_special_tokens=False)
    seq = engine.add(Teacher(sess, forced), SamplingParams(max_tokens=len(forced)))
    for _ in engine.run(seq):
        pass
    mask = transcript_mask(sess.layout, seq.token_texts, block_size=engine.block_size,
                           chunk_texts=[c.text for c in sess.chunks], scaffold_local=True)
    bs = engine.block_size
    for read in seq.reads:
        seen = torch.zeros(mask.shape[1], dtype=torch.bool)
        for b in read.blocks:
            seen[b * bs : min((b + 1) * bs, read.length)] = True
        assert torch.equal(mask[read.length - 1], seen), f"output {read.index}"
    assert {Mode.LOCAL, Mode.FOCUS, Mode.ANSWER} <= {s.mode for s in sess.steps}
