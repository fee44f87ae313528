"""The sparse baselines: each one's selection rule, pinned; and, on the live engine,
every decode step reads exactly the budget (checked against the read counter)."""

from __future__ import annotations

import pytest
import torch

from declattn.eval.arms import ArmRunner, ArmSettings, budget_from_da
from declattn.eval.baselines import (
    BlockBounds,
    budget_count,
    quest_scores,
    quest_view,
    sink_blocks,
    streaming_view,
)
from declattn.eval.tasks import generate


def test_streaming_keeps_sink_and_most_recent_blocks():
    assert streaming_view(20, 6, 1) == [0, 15, 16, 17, 18, 19]
    assert streaming_view(20, 6, 2) == [0, 1, 16, 17, 18, 19]
    assert streaming_view(5, 6, 1) == [0, 1, 2, 3, 4]  # short sequence: everything
    assert streaming_view(20, 1, 1) == [19]  # the newest block always wins
    with pytest.raises(ValueError):
        streaming_view(20, 0, 1)


def test_quest_keeps_sink_newest_and_highest_scores():
    scores = [0.0, 5.0, 1.0, 9.0, 9.0, 2.0, 7.0, 3.0, 0.5]  # block 9 is the newest
    # sink (0) and newest (9) forced; then 3 and 4 (tie: lower id first), then 6.
    assert quest_view(scores, 10, 5, 1) == [0, 3, 4, 6, 9]
    assert quest_view(scores, 10, 3, 1) == [0, 3, 9]
    assert quest_view(scores, 10, 2, 1) == [0, 9]
    # A huge score on the sink changes nothing: it is kept anyway, not counted twice.
    assert quest_view([99.0, *scores[1:]], 10, 4, 1) == [0, 3, 4, 9]
    assert quest_view(scores, 4, 6, 1) == [0, 1, 2, 3]


def test_quest_bound_is_an_upper_bound_and_max_over_heads():
    g = torch.Generator().manual_seed(0)
    n_kv, group, dim, bs, nb = 2, 3, 8, 4, 5
    keys = torch.randn(n_kv, nb, bs, dim, generator=g)
    q = torch.randn(n_kv * group, dim, generator=g)
    bound = quest_scores(q, keys.amin(2), keys.amax(2))
    exact = torch.einsum("hgd,hbtd->hgbt", q.view(n_kv, group, dim), keys).amax(-1)
    assert torch.all(bound >= exact.amax(dim=(0, 1)) - 1e-5)
    # Hand check of the bound for one block and one head: sum_d max(q*min, q*max).
    k0 = keys[0, 2]
    per_head = (q[0][None] * torch.stack([k0.amin(0), k0.amax(0)])).amax(0).sum()
    heads = [
        (q[h][None] * torch.stack([keys[h // group, 2].amin(0), keys[h // group, 2].amax(0)]))
        .amax(0)
        .sum()
        for h in range(n_kv * group)
    ]
    assert bound[2] == pytest.approx(max(float(x) for x in heads), rel=1e-5)
    assert float(per_head) <= float(bound[2]) + 1e-6


def test_budget_count_reads_the_newest_block_partly():
    c = budget_count(length=100, budget=3, block_size=16)  # 7 blocks, the last holds 4
    assert (c.logical, c.physical, c.vanilla_logical, c.vanilla_physical) == (36, 48, 100, 112)
    assert budget_count(20, 5, 16).physical == 32  # never more than exists
    assert sink_blocks(16, 16) == 1 and sink_blocks(17, 16) == 2


def test_budget_comes_from_da_mean_blocks_per_step():
    row = {"block_size": 16, "totals": {"steps": 4, "physical": 16 * 42}}  # 10.5 blocks/step
    assert budget_from_da(row, 16) == (10, 10.5)  # rounds half to even, as round() does
    row = {"block_size": 16, "totals": {"steps": 0, "physical": 0}}
    assert budget_from_da(row, 16)[0] == 3  # at least sink + one chosen + newest


@pytest.fixture(scope="module")
def sample(task_data):
    return generate("niah_single_noise", task_data, 1024, 0)


@pytest.mark.parametrize("arm", ["streaming", "quest"])
def test_every_step_reads_exactly_the_budget(tiny_engine, sample, arm):
    budget = 7
    runner = ArmRunner(tiny_engine, ArmSettings(max_tokens=10))
    run = runner.run(arm, sample.context, sample.question, budget)
    sess, reads = run.session, run.seq.reads
    assert len(reads) == len(sess.steps) == 9
    per_token = tiny_engine.pool.bytes_per_token
    n_layers = tiny_engine.loaded.config.num_layers
    for read, step in zip(reads, sess.steps, strict=True):
        n_blocks = -(-read.length // 16)
        assert n_blocks > budget
        assert len(read.blocks) == budget
        assert n_blocks - 1 in read.blocks and 0 in read.blocks
        # Bytes: every global layer read budget blocks, the newest only up to the token.
        assert read.global_bytes == n_layers * step.logical * per_token
        assert step.physical == budget * 16
    if arm == "streaming":
        for read, view in zip(reads, sess.expected_views, strict=True):
            assert read.blocks == view
            assert read.layers_agree
    else:
        for read, chosen in zip(reads, sess.selected, strict=True):
            assert read.blocks == chosen[0]  # the counter's first global layer
            assert all(len(b) == budget for b in chosen.values())
        assert sess.meta_bytes > 0


def test_quest_picks_what_the_rule_picks_from_the_pool(tiny_engine, sample, monkeypatch):
    """Selections made live equal the rule applied to bounds recomputed from the pool."""
    from declattn.eval import arms, baselines

    captured = []

    class Spy(baselines.QuestSession):
        def select_blocks(self, layer, q):
            n_blocks = -(-self._length // self.block_size)
            fresh = BlockBounds(self.bounds.keys)
            kmin, kmax = fresh.get(layer, n_blocks - 1)
            expected = quest_view(quest_scores(q, kmin, kmax), n_blocks, self.budget, self.sink)
            got = super().select_blocks(layer, q)
            captured.append((got, expected))
            return got

    monkeypatch.setattr(arms, "QuestSession", Spy)
    ArmRunner(tiny_engine, ArmSettings(max_tokens=3)).run(
        "quest", sample.context, sample.question, 5
    )
    assert captured and all(got == exp for got, exp in captured)
    assert len({tuple(g) for g, _ in captured}) > 1  # the choice follows the query
