"""Greedy picks what ``torch.argmax`` picks: first index on ties, NaN as the largest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.engine.sampler import SamplingParams, greedy, sample

SPECIAL = st.sampled_from([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(-1e4, 1e4, width=32), SPECIAL), min_size=1, max_size=64))
def test_greedy_agrees_with_torch_argmax(values):
    logits = torch.tensor(values, dtype=torch.float32)
    assert greedy(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_sample_takes_the_first_of_tied_largest_logits(dtype):
    logits = torch.zeros(151936, dtype=dtype)
    logits[[7, 40_000, 151_935]] = 3.0
    assert sample(logits, SamplingParams(), None) == 7
    assert greedy(logits) == 7
