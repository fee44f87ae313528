"""declattn: Declarative Attention, with an engine that really reads fewer KV bytes.

The protocol names (``segment``, ``render_prompt``, ``TagReader``, ``Scope``,
``replay``) import no torch. ``Engine`` is loaded on first use, so protocol-only users
never pay for torch.
"""

from __future__ import annotations

from typing import Any

from declattn.da.replay import Replay, replay
from declattn.da.scope import Scope, StepCount
from declattn.protocol.grammar import DeclineReason
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode
from declattn.protocol.prompt import RenderedPrompt, render_plain, render_prompt
from declattn.protocol.segment import Chunk, SegmentError, segment
from declattn.protocol.tags import Declaration, TagReader

__version__ = "0.1.0"

_LAZY = {
    "Engine": "declattn.api",
    "Answer": "declattn.api",
    "DAOptions": "declattn.da.options",
    "SamplingParams": "declattn.engine.sampler",
    "Client": "declattn.server.client",
}

__all__ = [
    "Chunk",
    "Declaration",
    "DeclineReason",
    "Layout",
    "Mode",
    "RenderedPrompt",
    "Replay",
    "Scope",
    "SegmentError",
    "Span",
    "StepCount",
    "TagReader",
    "render_plain",
    "render_prompt",
    "replay",
    "segment",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'declattn' has no attribute {name!r}")
