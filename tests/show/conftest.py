"""Synthetic run records for the show tests: no model, real replay and scope arithmetic.

The steps come from ``declattn.replay`` and the blocks read from ``Scope``, so the
records have the shape and the one-step lag a live run writes, with text chosen to
exercise every mode, a decline, and HTML that must be escaped.
"""

from __future__ import annotations

from typing import Any

import pytest

from declattn.protocol.layout import Layout, Span
from declattn.record import block_ranges
from declattn.replay import replay
from declattn.scope import Scope

BLOCK = 16

CHUNK_TEXTS = (
    "The lighthouse was built in 1871 by the harbour board.",
    "Mary Hale kept the light from 1903 to 1931. <b>bold</b> & <script>alert('chunk')</script>",
    "The herring catch collapsed in the 1920s.",
)

# global -> focus 2 -> global -> declined focus (unknown id) -> local -> global -> answer
TOKEN_TEXTS = (
    "Let",
    " me",
    " look",
    ".\n",
    "<focus",
    ' magic_chunks="2">',
    " The",
    " keeper",
    " was",
    " Mary",
    " Hale",
    ".",
    "</focus>",
    "\n",
    '<focus magic_chunks="9">',
    " hmm",
    "\n",
    "<local>",
    " So",
    " 1903",
    " a < b",
    "</local>",
    "<answer>",
    "Mary",
    " Hale &",
    " <script>alert('out')</script>",
    "</answer>",
)


def make_record(
    layout: Layout,
    chunk_texts: tuple[str, ...],
    token_texts: tuple[str, ...],
    *,
    block_size: int = BLOCK,
) -> dict[str, Any]:
    """A run record as ``build_record`` writes it, with reads equal to the scope's blocks."""
    rep = replay(layout, list(token_texts), block_size=block_size)
    steps = []
    for s in rep.steps:
        d = s.to_dict()
        scope = Scope(layout, s.mode, s.focus_ids)
        d["blocks_read"] = block_ranges(scope.kept_blocks(s.length, block_size))
        d["seconds"] = 0.01
        steps.append(d)
    text = "".join(token_texts)
    out = rep.to_dict()
    chunks = []
    start = 0
    for i, (span, body) in enumerate(zip(layout.chunks, chunk_texts, strict=True), start=1):
        chunks.append(
            {"id": i, "start": start, "end": start + len(body), "tokens": len(span), "text": body}
        )
        start += len(body)
    return {
        "version": 1,
        "date": "2025-01-01T00:00:00+00:00",
        "machine": {},
        "model": "synthetic",
        "arm": "da",
        "question": "Who kept the light <i>after</i> 1903?",
        "block_size": block_size,
        "prompt_tokens": layout.prompt_len,
        "output": {
            "text": text,
            "answer": "Mary Hale & <script>alert('out')</script>",
            "finish_reason": "answer",
            "token_texts": list(token_texts),
        },
        "declarations": out["declarations"],
        "steps": steps,
        "totals": out["totals"],
        "by_mode": out["by_mode"],
        "timings": {"prefill_seconds": 0.1, "decode_seconds": 0.2},
        "layout": layout.to_dict(),
        "chunks": chunks,
        "prompt_style": "inline",
    }


SMALL_LAYOUT = Layout(
    prompt_len=400,
    sink=Span(0, 16),
    chunks=(Span(20, 120), Span(128, 250), Span(256, 360)),
    question=Span(364, 400),
)


@pytest.fixture
def record() -> dict[str, Any]:
    return make_record(SMALL_LAYOUT, CHUNK_TEXTS, TOKEN_TEXTS)
