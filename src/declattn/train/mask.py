"""The training attention mask of a DA transcript, from the decoder's own scope rules.

A teacher-forced row must see exactly what the engine reads when it decodes the same
token, or the model learns to answer from text it will not have at run time. So the
mask is not a second implementation of the rules: ``replay`` (the same tag reader and
one-step lag a live session uses) gives each decode step's mode and focus ids, and
``Scope.kept_block_ranges`` (what ``DASession.view`` hands the engine) gives the
blocks. A test derives both for one transcript and compares them row by row.

Rows and what they predict, for a prompt of P tokens and outputs ``o_0 .. o_{n-1}``
(inputs are the prompt then ``o_0 .. o_{n-2}``):

- rows ``0 .. P-1``: the prompt, causal (the engine prefills it with full attention);
  row ``P-1`` predicts ``o_0``, as the prefill does. ``chunk_local=True`` confines a
  chunk's rows to the sink and their own chunk, an option for training only;
- row ``P-1+k`` (``k >= 1``) is decode step k: it predicts ``o_k`` and sees the kept
  blocks of step k, cut at its own position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from declattn.da.replay import replay
from declattn.da.scope import DEFAULT_BLOCK_SIZE, Scope
from declattn.protocol.layout import Layout


def transcript_mask(
    layout: Layout,
    output_texts: Sequence[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    masking: bool = True,
    chunk_local: bool = False,
    chunk_texts: Sequence[str] | None = None,
    line_start: bool = False,
    scaffold_local: bool = False,
) -> Tensor:
    """``[L, L]`` bool, True where row (query) may read column (key); L = P + n - 1.

    ``chunk_texts``, ``line_start`` and ``scaffold_local`` are the request's own (as
    ``replay`` takes them): without the chunk texts a find focus is declined, as live."""
    p = layout.prompt_len
    n = len(output_texts)
    if n < 1:
        raise ValueError("a transcript needs at least one output token")
    size = p + n - 1
    mask = torch.ones(size, size, dtype=torch.bool).tril_()
    if chunk_local:
        _confine_chunks(mask, layout)
    if not masking:
        return mask
    steps = replay(layout, output_texts, block_size, line_start, chunk_texts, scaffold_local).steps
    for step in steps:
        row = step.length - 1  # the step's query position
        scope = Scope(layout, step.mode, step.focus_ids)
        mask[row, :] = False
        for r in scope.kept_block_ranges(step.length, block_size):
            mask[row, r.start * block_size : min(r.end * block_size, step.length)] = True
    return mask


def _confine_chunks(mask: Tensor, layout: Layout) -> None:
    sink = layout.sink
    for span in layout.chunks:
        rows = mask[span.start : span.end]
        rows[:, : span.start] = False
        rows[:, sink.start : sink.end] = True
