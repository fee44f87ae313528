"""The facade: the one way in to the engine for everything above it.

``Engine`` loads a model and answers requests (DA or plain); ``Document`` and ``Chat``
ask many questions over one context; ``Answer``/``Stats``/``Delta`` are what comes back;
``session.py`` holds the engine controllers that implement a request (plain or DA, the
latter driving the torch-free DA core of ``declattn.da``).
"""

from declattn.api.document import Chat, Document
from declattn.api.facade import (
    CONSTRAIN_BELOW_PARAMS,
    DEFAULT_KV_TOKENS,
    DEFAULT_PREFILL_CHUNK,
    Engine,
    Load,
    RunVanilla,
)
from declattn.api.heap import frozen_heap
from declattn.api.results import Answer, Delta, Stats

__all__ = [
    "CONSTRAIN_BELOW_PARAMS",
    "DEFAULT_KV_TOKENS",
    "DEFAULT_PREFILL_CHUNK",
    "Answer",
    "Chat",
    "Delta",
    "Document",
    "Engine",
    "Load",
    "RunVanilla",
    "Stats",
    "frozen_heap",
]
