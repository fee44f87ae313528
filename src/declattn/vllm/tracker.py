"""One DA request inside vLLM's engine core: its output tokens, tag reader and scope.

vLLM hands the logits processor a reference to each request's live list of output
token ids. The tracker reads new tokens from it lazily (whoever asks first at a step,
the attention metadata builder or the logits processor, brings it up to date), turns
them into text with the same incremental detokenizer as our engine, and feeds the tag
reader. So at the step that produces output token ``k`` the scope is the reader's state
after tokens ``0..k-1``: the one-step lag of our engine (see ``declattn.replay``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from declattn.constrain import FocusConstraint, FocusVocab
from declattn.engine.detok import Detokenizer
from declattn.protocol.tags import TagReader
from declattn.scope import Scope
from declattn.vllm.xargs import DASpec


@dataclass(frozen=True)
class ReadRecord:
    """What the patched builder handed the kernel for one decode step of one request.

    ``length``: positions the step sees (``prompt_len + k``); ``kept``: the scope's kept
    logical blocks; ``logical``: the logical blocks actually placed in the compacted
    block-table row (equal to ``kept`` unless something is wrong); ``physical``: the KV
    block ids in that row; ``seq_len``: the sequence length handed to the kernel.
    """

    step: int
    length: int
    mode: str
    focus_ids: tuple[int, ...]
    kept: tuple[int, ...]
    logical: tuple[int, ...]
    physical: tuple[int, ...]
    seq_len: int
    group: int


@dataclass
class RequestTracker:
    """A DA request's protocol state, kept in step with vLLM's output list."""

    spec: DASpec
    output_ids: Sequence[int]
    tokenizer: Any
    vocab: FocusVocab | None = None
    reader: TagReader = field(init=False)
    detok: Detokenizer = field(init=False)
    constraint: FocusConstraint | None = field(init=False, default=None)
    fed: int = field(init=False, default=0)
    text: str = field(init=False, default="")
    reads: list[ReadRecord] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.reader = TagReader(self.spec.layout.n_chunks, line_start=self.spec.line_start)
        self.detok = Detokenizer(self.tokenizer)
        if self.spec.constrain and self.vocab is not None:
            self.constraint = FocusConstraint(self.vocab, self.spec.layout.n_chunks)

    @property
    def n_out(self) -> int:
        """Output tokens vLLM has appended so far (placeholders of async scheduling,
        negative ids, are not tokens yet)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] < 0:
            n -= 1
        return n

    def sync(self) -> None:
        """Feed the tag reader every output token it has not seen."""
        n = self.n_out
        while self.fed < n:
            text = self.detok.add(int(self.output_ids[self.fed]))
            self.text += text
            self.reader.feed(text)
            self.fed += 1

    def scope(self) -> Scope:
        self.sync()
        return Scope(self.spec.layout, self.reader.mode, self.reader.focus_ids)

    def kept_blocks(self, length: int, block_size: int) -> tuple[int, ...] | None:
        """The logical blocks the decode step that sees ``length`` positions may read;
        None when nothing is skipped (DA-nm, or a length that is not this request's)."""
        if not self.spec.masking:
            return None
        if length != self.spec.layout.prompt_len + self.n_out:
            return None  # not the step we track (a recompute, a draft): read everything
        return tuple(self.scope().kept_blocks(length, block_size))

    def process_logits(self, row: Tensor) -> Tensor:
        """Forced tokens first (teacher forcing), else the focus-id constraint."""
        self.sync()
        k = self.n_out
        if k < len(self.spec.force):
            out = torch.full_like(row, float("-inf"))
            out[self.spec.force[k]] = 0.0
            return out
        if self.constraint is not None:
            return self.constraint.apply(row, self.reader.pending, k)
        return row
