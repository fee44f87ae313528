"""The app's lifespan: with ``freeze_heap`` (as ``declattn serve`` runs it) the heap built
by its start is frozen while it serves (``api/heap.py``) and handed back at shutdown;
without it, an app embedded in another program leaves the collector alone."""

from __future__ import annotations

import gc
from typing import Any

import pytest


@pytest.mark.parametrize("freeze", [True, False])
def test_serving_freezes_the_heap_only_when_asked(server_factory: Any, freeze: bool) -> None:
    before = gc.get_freeze_count()
    server = server_factory(kv_blocks=64, freeze_heap=freeze)
    try:
        assert (gc.get_freeze_count() > before) == freeze
    finally:
        server.stop()
    if before == 0:  # another server of the session may hold the heap frozen
        assert gc.get_freeze_count() == 0
