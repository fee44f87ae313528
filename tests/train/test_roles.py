"""Reply-token roles, and the teacher-forced report that scores each role apart."""

from __future__ import annotations

import random
from typing import Any

import pytest

from declattn.train.data import da_tiny_options, encode
from declattn.train.roles import ROLES, reply_roles, role_report
from declattn.train.tasks import make_episode

ONE_HOP = [
    "format", "key copy", "format", "format", "chunk id", "format", "key copy",
    "value lookup", "format", "format", "answer copy", "format",
]


def test_roles_of_one_and_two_hop_replies(tiny_tok: Any) -> None:
    one = encode(tiny_tok, make_episode(random.Random(3), 6, False), da_tiny_options())
    assert reply_roles(one.output_texts) == ONE_HOP
    two = encode(tiny_tok, make_episode(random.Random(3), 6, True), da_tiny_options())
    roles = reply_roles(two.output_texts)
    assert roles.count("chunk id") == roles.count("value lookup") == 2
    assert roles[-2:] == ["answer copy", "format"]
    chunk_tokens = [t for t, r in zip(two.output_texts, roles, strict=True) if r == "chunk id"]
    assert chunk_tokens == [str(c) for c in make_episode(random.Random(3), 6, True).evidence_chunks]


@pytest.mark.parametrize("two_hop", [False, True])
def test_role_report_splits_the_training_loss(tiny_tok: Any, random_tiny: Any, two_hop) -> None:
    from declattn.train.trainer import collate, loss_of

    report = role_report(random_tiny, tiny_tok, 4, samples=6, seed=2, two_hop=two_hop)
    assert [r.role for r in report] == list(ROLES)
    hops = 2 if two_hop else 1
    # per hop: five tags, two key copies, a chunk id, a value; then <answer> v </answer>
    per_reply = {"format": 5 * hops + 2, "key copy": 2 * hops, "chunk id": hops,
                 "value lookup": hops, "answer copy": 1}
    for r in report:
        want = 6 * per_reply[r.role]
        assert r.tokens == want and 0.0 <= r.accuracy <= 1.0
    # the same documents through the trainer's own loss: the roles partition it
    from declattn.train.evaluate import EVAL_SEED_BASE

    rng = random.Random(EVAL_SEED_BASE + 17 * 2 + 4)
    batch = collate(
        [encode(tiny_tok, make_episode(rng, 4, two_hop), da_tiny_options()) for _ in range(6)],
        tiny_tok.pad_token_id,
    )
    total = sum(r.loss * r.tokens for r in report) / sum(r.tokens for r in report)
    assert abs(total - float(loss_of(random_tiny, batch).detach())) < 1e-4
