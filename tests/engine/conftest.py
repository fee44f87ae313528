"""Engine tests share one fixture: torch runs single-threaded here."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The two cores are shared: a second OpenMP thread that keeps being descheduled turns
    every small op into a long wait, so these tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=("native", "torch"))
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once through the fused decode kernel and once through the torch
    fallback (see ``paged_world.force_kernel``)."""
    from paged_world import force_kernel

    force_kernel(monkeypatch, request.param)
    return request.param
