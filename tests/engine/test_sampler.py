"""Greedy picks what ``torch.argmax`` picks: first index on ties, NaN as the largest; the
native argmax (``csrc/argmax.cpp``) and numpy's (the path where the layer ops are switched
to torch) alike, in bf16 and fp32, on rows that cross its 16 lanes and its split into one
part per thread."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from declattn.engine.models import fused
from declattn.engine.sampler import SamplingParams, greedy, sample

SPECIAL = st.sampled_from([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan")])


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    """Greedy on the native argmax, or on numpy's with the layer ops switched to torch."""
    if request.param == "numpy":
        monkeypatch.setenv(fused.ENV_SWITCH, "torch")
    elif fused.layer_ops() is None:
        pytest.skip("no native library")
    fused.layer_ops.cache_clear()
    yield request.param
    monkeypatch.undo()
    fused.layer_ops.cache_clear()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the path holds
@given(
    st.lists(st.one_of(st.floats(-1e4, 1e4, width=32), SPECIAL), min_size=1, max_size=100),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_greedy_agrees_with_torch_argmax(path, values, dtype):
    logits = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert greedy(logits) == int(torch.argmax(logits))


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    """torch's threads for the test (the suite runs on one: the parts need more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [151936, 40_001, 32_768 + 5])
def test_greedy_over_long_rows_takes_the_first_largest_across_the_parts(
    path, threads, dtype, n
):
    """Rows long enough to be split among threads: the largest value in several parts,
    a NaN in a later part than the largest, every value -inf, a strided view."""
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(n, generator=gen).to(dtype)
    assert greedy(logits) == int(torch.argmax(logits))
    tied = torch.zeros(n, dtype=dtype)
    tied[[n - 1, n // 2 + 1, n // 2, 17]] = 2.0
    assert greedy(tied) == 17
    tied[17] = 0.0
    assert greedy(tied) == n // 2
    tied[n - 3] = float("nan")
    assert greedy(tied) == n - 3 == int(torch.argmax(tied))
    assert greedy(torch.full((n,), float("-inf"), dtype=dtype)) == 0
    strided = torch.randn(n, 2, generator=gen).to(dtype)[:, 1]  # n values, 2 apart
    assert greedy(strided) == int(torch.argmax(strided))


def test_the_native_argmax_refuses_what_it_cannot_read():
    ops = fused.layer_ops()
    if ops is None:
        pytest.skip("no native library")
    with pytest.raises(RuntimeError, match="bf16 or fp32 logits"):
        ops.argmax(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="one non-empty row"):
        ops.argmax(torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="one non-empty row"):
        ops.argmax(torch.zeros(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_sample_takes_the_first_of_tied_largest_logits(dtype):
    logits = torch.zeros(151936, dtype=dtype)
    logits[[7, 40_000, 151_935]] = 3.0
    assert sample(logits, SamplingParams(), None) == 7
    assert greedy(logits) == 7
