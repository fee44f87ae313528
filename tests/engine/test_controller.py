"""Controllers the engine calls: the forced transcript of benchmarks and oracle tests."""

from __future__ import annotations

import torch

from declattn.engine.controller import Controller, Forced


class Doubling(Controller):
    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * 2


def test_forced_logits_leave_only_the_scripted_token_each_step() -> None:
    forced = Forced(Doubling([1, 2]), [5, 2, 5, 7])
    logits = torch.randn(9)
    for token in [5, 2, 5, 7]:
        out = forced.process_logits(logits)
        assert int(out.argmax()) == token and out[token] == 0
        assert bool(torch.isinf(out).sum() == 8)  # every other token is -inf
        forced.on_token(token, "")
    assert torch.equal(forced.process_logits(logits), logits * 2)  # past the script


def test_forced_logits_follow_a_change_of_shape() -> None:
    forced = Forced(Controller([1]), [7, 1, 2])
    assert int(forced.process_logits(torch.zeros(9)).argmax()) == 7
    forced.on_token(7, "")
    out = forced.process_logits(torch.zeros(4, dtype=torch.bfloat16))  # 7 is past its end
    assert out.shape == (4,) and out.dtype == torch.bfloat16 and int(out.argmax()) == 1
    forced.on_token(1, "")
    out = forced.process_logits(torch.zeros(4, dtype=torch.bfloat16))
    assert int(out.argmax()) == 2 and bool(torch.isinf(out).sum() == 3)


def test_kept_logits_are_the_models_not_the_forced_ones() -> None:
    forced = Forced(Controller([1]), [0, 1], keep_logits=True)
    first = torch.arange(3.0)
    forced.process_logits(first)
    forced.on_token(0, "")
    forced.process_logits(torch.ones(3))
    assert torch.equal(forced.logits[0], first) and torch.equal(forced.logits[1], torch.ones(3))
