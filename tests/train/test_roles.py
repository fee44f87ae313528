"""Reply-token roles, and the teacher-forced report that scores each role apart."""

from __future__ import annotations

import random
from typing import Any

import pytest

from declattn.train.data import da_tiny_options, encode
from declattn.train.roles import ROLES, reply_roles, role_report, score_roles
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
def test_role_scores_split_the_training_loss(tiny_tok: Any, random_tiny: Any, two_hop) -> None:
    from declattn.train.trainer import collate, loss_of

    rng = random.Random(7)
    examples = [
        encode(tiny_tok, make_episode(rng, 4, two_hop), da_tiny_options()) for _ in range(6)
    ]
    report = score_roles(random_tiny, examples, tiny_tok.pad_token_id)
    assert [r.role for r in report] == list(ROLES)
    hops = 2 if two_hop else 1
    # per hop: five tags, two key copies, a chunk id, a value; then <answer> v </answer>
    per_reply = {"format": 5 * hops + 2, "key copy": 2 * hops, "chunk id": hops,
                 "value lookup": hops, "answer copy": 1}
    for r in report:
        assert r.tokens == 6 * per_reply[r.role] and 0.0 <= r.accuracy <= 1.0
    # the roles partition the trainer's own loss on the same batch
    batch = collate(examples, tiny_tok.pad_token_id)
    total = sum(r.loss * r.tokens for r in report) / sum(r.tokens for r in report)
    assert abs(total - float(loss_of(random_tiny, batch).detach())) < 1e-4


def test_role_report_scores_fresh_documents(tiny_tok: Any, random_tiny: Any) -> None:
    report = role_report(random_tiny, tiny_tok, 5, samples=3, seed=1)
    assert {r.role: r.tokens for r in report}["chunk id"] == 3
