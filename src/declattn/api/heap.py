"""The garbage collector while an engine serves.

A process that has imported torch and transformers and loaded a model holds a few hundred
thousand objects the collector tracks (modules, functions, classes), nearly all of them
alive until it exits. CPython walks every one of them in each full collection, and starts
one whenever enough new objects have outlived two younger collections: every few hundred
steps of a decode batch, a pause of a tenth of a second or more that every running stream
feels between two tokens. Moving the objects alive when serving starts out of the
collector's way (``gc.freeze``) removes those walks; what is made while serving is
collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, the objects alive at its start are left out of collections.

    On exit they are handed back, unless a block around this one froze first (its exit
    hands them back). Garbage is collected first, so nothing dead is frozen."""
    outermost = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()
