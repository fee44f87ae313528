"""Sharing a prompt's prefill between arms changes nothing an arm computes."""

from __future__ import annotations

import pytest
import torch

from declattn.engine.sampler import SamplingParams
from declattn.eval.prefix import prefill_prefix, start_from


class Keep:
    """Records the logits of every step and forwards nothing else."""

    def __init__(self):
        self.logits = []

    def process_logits(self, logits):
        self.logits.append(logits.clone())
        return logits


@pytest.fixture(scope="module")
def prompt(tiny_engine):
    sess = tiny_engine.session("Harbour log. " * 200, "How many boats?", da=False)
    return sess.prompt_ids


def test_restored_prefix_gives_the_same_response(tiny_engine, prompt):
    core = tiny_engine.core
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fresh = Keep()
    seq = core.add(prompt, params, fresh)
    for _ in core.run(seq):
        pass
    prefix = prefill_prefix(core, prompt)
    assert prefix.n_positions == len(prompt) - 1
    runs = []
    for _ in range(2):
        ctl = Keep()
        again = start_from(core, prefix, params, ctl)
        assert again.prefilled == len(prompt) - 1
        for _ in core.run(again):
            pass
        runs.append((again.output_ids, ctl.logits))
    assert runs[0][0] == runs[1][0] == seq.output_ids
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)  # two arms from one prefix: bit for bit the same
    for a, b in zip(runs[0][1], fresh.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not core.has_work and not core.cache.seq_ids  # everything freed


def test_prefix_holds_the_prompt_kv(tiny_engine, prompt):
    core = tiny_engine.core
    prefix = prefill_prefix(core, prompt)
    seq = start_from(core, prefix, SamplingParams(max_tokens=1), None)
    slots = core.cache.slots(seq.seq_id, 0, prefix.n_positions)
    for layer in range(len(core.cache.k)):
        assert torch.equal(core.cache.k[layer][:, slots], prefix.k[layer])
    core.abort(seq)
    with pytest.raises(ValueError):
        prefill_prefix(core, prompt[:1])
