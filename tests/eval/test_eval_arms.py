"""Arms over one prompt share its prefill through the engine's prefix cache, and that
changes nothing an arm computes: its prefill is bit for bit a fresh engine's."""

from __future__ import annotations

import torch

from declattn.engine.controller import Forced
from declattn.engine.sampler import SamplingParams
from declattn.eval.arms import ArmRunner, ArmSettings


def _logits_of(engine, sess, n: int = 8) -> tuple[list[int], list[torch.Tensor], int]:
    ctl = Forced(sess, [], keep_logits=True)  # forces nothing: only keeps the logits
    seq = engine.add(ctl, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in engine.run(seq):
        pass
    return seq.output_ids, ctl.logits, seq.cached_tokens


def test_arms_after_the_first_reuse_the_prompt_and_match_a_fresh_prefill(tiny_engine):
    context, question = "Harbour log. " * 200, "How many boats?"
    runner = ArmRunner(tiny_engine.with_pool(512), ArmSettings(max_tokens=8))
    first = runner.run("da-nm", context, question)
    second = runner.run("da", context, question)
    n = len(first.session.prompt_ids)
    assert first.seq.cached_tokens == 0
    assert second.seq.cached_tokens == (n - 1) // 512 * 512 > 0  # whole prefill chunks
    fresh = tiny_engine.with_pool(512, prefix_caching=False)
    cached = tiny_engine.with_pool(512)
    sess = lambda: tiny_engine.session(context, question, da=False)  # noqa: E731
    ids0, logits0, hit0 = _logits_of(fresh, sess())
    _logits_of(cached, sess())  # fills the cache
    ids1, logits1, hit1 = _logits_of(cached, sess())
    assert hit0 == 0 and hit1 > 0
    assert ids0 == ids1
    # The prefill's logits are bit for bit a fresh prefill's (fp32, the same chunks);
    # decode steps then read the shared blocks from other physical places, and decode
    # attention merges per-run partials, which moves the last bits only.
    assert torch.equal(logits0[0], logits1[0])
    for a, b in zip(logits0[1:], logits1[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not cached.has_work and cached.pool.in_use == 0  # everything released
