"""How fast the segmenter cuts a long context with a real tokenizer.

Segmenting is the first step of every request, and contexts reach a million tokens; a
segmenter that re-tokenised the text per probe would cost minutes there. This measures
the whole call on a repeated sample text, so a regression shows as a number.

Run: ``declattn bench segment [--tokens N] [--tokenizer NAME]``.
"""

from __future__ import annotations

import importlib.resources
import time
from typing import Any

from declattn.protocol.segment import segment, token_counter

SAMPLE = "sample_essay.txt"


def sample_text() -> str:
    """The bundled English essay: ordinary prose with paragraphs, written for this project."""
    return importlib.resources.files("declattn").joinpath("data", SAMPLE).read_text("utf-8")


def bench_segment(
    tokenizer: Any, n_tokens: int = 1_000_000, text: str | None = None
) -> dict[str, Any]:
    """Segment about ``n_tokens`` of text (``text`` or the sample, repeated) and time it.

    Only the ``segment`` call is timed; building the text and counting its tokens for the
    report happen outside the clock.
    """
    base = sample_text() if text is None else text
    if not base.strip():
        raise ValueError("the base text is empty or whitespace only")
    count = token_counter(tokenizer)
    # Keep a blank line between copies so each copy starts a paragraph.
    sep = "" if base.endswith("\n\n") else "\n" if base.endswith("\n") else "\n\n"
    unit = base + sep
    reps = max(1, -(-n_tokens // max(1, count(unit))))
    context = unit * reps
    tokens = count(context)

    start = time.perf_counter()
    chunks = segment(context, count)
    seconds = time.perf_counter() - start

    if "".join(c.text for c in chunks) != context:
        raise AssertionError("segmentation lost text")  # would make the timing meaningless
    sizes = [c.tokens for c in chunks]
    return {
        "tokens": tokens,
        "chars": len(context),
        "chunks": len(chunks),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else float("inf"),
        "max_chunk_tokens": max(sizes),
        "mean_chunk_tokens": sum(sizes) / len(sizes),
    }
