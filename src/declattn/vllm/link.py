"""How the attention metadata builder finds the DA state of its engine.

vLLM gives the logits processor and the metadata builders nothing in common but the
engine's ``VllmConfig`` object, and builds them in the same engine-core process. So the
processor registers itself here under that config, and a patched builder looks it up
with its own. This table is the one piece of process-wide state the plugin needs: the
patch itself is process-wide (it changes a vLLM class), and one process may host several
engines. The table holds processors weakly, so an engine that is gone leaves nothing
behind; it holds the config, so an id is never reused while its entry lives.
"""

from __future__ import annotations

import weakref
from typing import Any

_ENGINES: dict[int, tuple[Any, weakref.ref]] = {}


def register(vllm_config: Any, processor: Any) -> None:
    key = id(vllm_config)
    _ENGINES[key] = (vllm_config, weakref.ref(processor))
    weakref.finalize(processor, _forget, key)


def _forget(key: int) -> None:
    entry = _ENGINES.get(key)
    if entry is not None and entry[1]() is None:  # not a newer processor under the key
        _ENGINES.pop(key, None)


def unregister(vllm_config: Any) -> None:
    _ENGINES.pop(id(vllm_config), None)


def lookup(vllm_config: Any) -> Any | None:
    """The DA processor of the engine that owns ``vllm_config``, if it has one."""
    entry = _ENGINES.get(id(vllm_config))
    if entry is None or entry[0] is not vllm_config:
        return None
    return entry[1]()


def processors() -> list[Any]:
    """Every live DA processor of this process (an in-process engine's: tests, benches)."""
    live = (ref() for _, ref in _ENGINES.values())
    return [p for p in live if p is not None]
