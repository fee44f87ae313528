"""Two-pass teacher forcing gives the one-pass forward's logits, and its gradient reaches
the adapters through the rows after the frozen prefix only."""

from __future__ import annotations

import random

import pytest
import torch

from declattn.train.da_tiny import TinySpec, hf_config, new_model
from declattn.train.data import da_tiny_options, encode
from declattn.train.lora import LoRASpec, apply_lora
from declattn.train.prefix import two_pass_logits, two_pass_loss
from declattn.train.tasks import make_episodes
from declattn.train.trainer import collate, output_logits


@pytest.fixture
def case(tiny_tok: object) -> tuple[torch.nn.Module, object]:
    spec = TinySpec(layers=2, aids=False)
    model = new_model(hf_config(spec, len(tiny_tok), tiny_tok.eos_token_id), seed=1).eval()
    episodes = make_episodes(random.Random(5), 6, [False, True, False])
    return model, encode(tiny_tok, episodes, da_tiny_options())


def test_two_passes_give_the_one_pass_logits(case: tuple) -> None:
    model, ex = case
    with torch.no_grad():
        want, want_t = output_logits(model, collate([ex], 0))
        frozen = ex.layout.question.start
        got, got_t = two_pass_logits(model, torch.tensor(ex.input_ids), torch.tensor(ex.labels),
                                     ex.mask, frozen)
    assert torch.equal(got_t, want_t)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)  # fp32, another summation order


def test_a_label_inside_the_frozen_prefix_is_refused(case: tuple) -> None:
    model, ex = case
    with pytest.raises(ValueError, match="frozen prefix"):
        two_pass_logits(model, torch.tensor(ex.input_ids), torch.tensor(ex.labels), ex.mask,
                        len(ex.input_ids))


def test_the_loss_trains_the_adapters(case: tuple) -> None:
    model, ex = case
    apply_lora(model, LoRASpec(rank=2, alpha=4.0))
    loss, n = two_pass_loss(model, torch.tensor(ex.input_ids), torch.tensor(ex.labels), ex.mask,
                            ex.layout.question.start)
    assert n == sum(1 for t in ex.labels if t != -100)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)
