"""Token contexts of the declattn_tiny family: neighbours never cross a region."""

from __future__ import annotations

import pytest
import torch

from declattn.engine.models.token_context import token_context


def test_neighbours_stop_at_region_boundaries_and_segments_are_chunk_ids() -> None:
    ids = [10, 11, 12, 13, 14, 15]
    regions = [0, 0, 3, 3, 3, -2]
    ctx = token_context(ids, regions, range(6), shift=2)
    assert ctx.previous.tolist() == [[-1, -1], [10, -1], [-1, -1], [12, -1], [13, 12], [-1, -1]]
    assert ctx.segments.tolist() == [0, 0, 3, 3, 3, 0]


@pytest.mark.parametrize("start", [2, 3, 5])
def test_a_window_with_an_offset_matches_the_whole(start: int) -> None:
    ids = list(range(100, 108))
    regions = [0, 1, 1, 1, 1, 2, 2, -2]
    whole = token_context(ids, regions, range(8), shift=2)
    lo = start - 2
    part = token_context(ids[lo:], regions[lo:], range(start, 8), shift=2, offset=lo)
    assert torch.equal(part.previous, whole.previous[start:])
    assert torch.equal(part.segments, whole.segments[start:])
