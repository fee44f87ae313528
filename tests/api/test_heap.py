"""``frozen_heap``: the objects alive at its start leave the collector's way, and come back."""

from __future__ import annotations

import gc
import weakref

from declattn.api import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_alive_at_the_start_are_frozen_and_handed_back() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_garbage_made_inside_is_still_collected() -> None:
    with frozen_heap():
        node = _Node()
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None


def test_garbage_at_the_start_is_collected_not_frozen() -> None:
    node = _Node()
    gone = weakref.ref(node)
    del node
    with frozen_heap():
        assert gone() is None


def test_an_inner_block_leaves_the_outer_one_frozen() -> None:
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
