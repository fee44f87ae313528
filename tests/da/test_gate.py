"""The break-even gate by the whole answer: bytes of the expected DA reply against the
plain reply's, from the context length, the chunk, the model's sizes and reply shapes."""

from __future__ import annotations

import pytest

from declattn.da.gate import CLASSIC_SHAPE, ECONOMY_SHAPE, ReplyShape, expected_cost

QWEN = {"weight_bytes": 392_000_000, "kv_bytes_per_token": 12_288}


def cost(context: int, shape: ReplyShape, chunk: int = 2048, scaffold: int = 400):
    return expected_cost(context_tokens=context, prompt_tokens=context + scaffold,
                         scaffold_tokens=scaffold, chunk_tokens=min(chunk, context),
                         shape=shape, **QWEN)


def test_the_bytes_are_the_sum_over_forwards() -> None:
    shape = ReplyShape(scaffold=2, focus=3, full=1, plain=4)
    c = expected_cost(context_tokens=1000, prompt_tokens=1100, scaffold_tokens=100,
                      chunk_tokens=200, weight_bytes=10, kv_bytes_per_token=1, shape=shape)
    assert c.da_bytes == 2 * (10 + 100) + 3 * (10 + 300) + 1 * (10 + 1100)
    assert c.plain_bytes == 4 * (10 + 1100)


def test_a_reply_that_reads_everything_longer_never_pays() -> None:
    for n in (4096, 16384, 32768):
        assert not cost(n, CLASSIC_SHAPE).run_da


def test_the_economy_reply_pays_more_as_the_context_grows() -> None:
    ratios = [cost(n, ECONOMY_SHAPE).ratio for n in (2048, 8192, 32768)]
    assert ratios == sorted(ratios, reverse=True)
    assert cost(32768, ECONOMY_SHAPE).run_da


def test_a_long_reply_over_a_short_context_does_not_pay() -> None:
    long = ReplyShape(scaffold=20, focus=20, full=0, plain=16)
    assert not cost(1024, long).run_da


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        cost(0, ECONOMY_SHAPE)


def test_a_batch_shares_the_weights_so_the_extra_forwards_cost_less() -> None:
    """Requests decoding together read the weights once a step: a request's share is
    1/N, its KV its own. A short plain answer that a lone DA reply cannot beat at 16K
    is beaten in a batch of 8 (the serving case)."""
    short = ReplyShape(scaffold=9, focus=7, full=0, plain=8)
    alone = cost(16384, short)
    batched = expected_cost(context_tokens=16384, prompt_tokens=16784, scaffold_tokens=400,
                            chunk_tokens=2048, shape=short, batch=8, **QWEN)
    assert not alone.run_da and batched.run_da
    assert batched.plain_bytes < alone.plain_bytes and batched.ratio < alone.ratio
    with pytest.raises(ValueError, match="batch"):
        expected_cost(context_tokens=1, prompt_tokens=1, scaffold_tokens=1, chunk_tokens=1,
                      shape=short, batch=0, **QWEN)
