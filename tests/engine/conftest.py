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
