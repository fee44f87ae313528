"""One tracked request inside vLLM's engine core: what each decode step may read.

``Tracker`` is what the builder wrapper (``patch.py``) and the processors ask of any
request the plugin follows: its kept blocks per decode step, the log of what the kernel
was handed, the steps that read everything and why, and its logits edits.
``RequestTracker`` is a DA request; the StreamingLLM baseline is ``streaming.py``.

A DA request's tracker reads new tokens from the output list lazily (whoever asks first
at a step, the attention metadata builder or the logits processor, brings it up to
date), turns them into text with the same incremental detokenizer as our engine, and
feeds the tag reader. So at the step that produces output token ``k`` the scope is the
reader's state after tokens ``0..k-1``: the one-step lag of our engine (see
``declattn.da.replay``).

The request's DA state is ``declattn.da.state.DAState``, the class our engine's
``DASession`` drives: the same reader, finder, constraints and scope rules. A find focus
(``<focus find="WORDS">``) is resolved against the chunk texts, which the engine core
rebuilds by decoding the prompt's chunk spans (exactly the chunk texts: the renderer
checks that every span decodes to its text). The state is built on the first token, once
the runner has handed over the prompt's chunk tokens (V1 at admission; V2 copies them
from its device buffer with the first step's tokens), so admitting a request costs
nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from declattn.api.constrained import constrain
from declattn.da.constrain import FocusVocab
from declattn.da.constrain_find import FindVocab
from declattn.da.constrain_open import OpeningVocab
from declattn.da.scope import Scope
from declattn.da.state import DAState
from declattn.engine.detok import Detokenizer
from declattn.protocol.layout import Layout
from declattn.protocol.tags import TagReader
from declattn.protocol.template import decode
from declattn.vllm.xargs import DASpec


@dataclass(frozen=True)
class ReadRecord:
    """What the patched builder handed the kernel for one decode step of one request.

    ``length``: positions the step sees (``prompt_len + k``); ``mode``: the scope's mode
    (``streaming`` for the baseline); ``kept``: the logical blocks the request's scope (or
    the baseline's policy) keeps; ``logical``: the logical blocks actually placed in the compacted
    block-table row (equal to ``kept`` unless something is wrong); ``physical``: the KV
    block ids in that row; ``seq_len``: the sequence length handed to the kernel;
    ``group``: the KV-cache group (its builder); ``token_bytes``: KV bytes one position
    holds over all layers of that group (the kernel reads ``seq_len`` positions).

    The block ids stay on the device (``physical_ids``) until ``physical`` is read, so
    recording a step costs no device-to-host copy.
    """

    step: int
    length: int
    mode: str
    focus_ids: tuple[int, ...]
    kept: tuple[int, ...]
    logical: tuple[int, ...]
    physical_ids: Tensor = field(repr=False)
    seq_len: int
    group: int
    token_bytes: int = 0

    @property
    def physical(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.physical_ids.tolist())

    @property
    def bytes_read(self) -> int:
        return self.seq_len * self.token_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "length": self.length, "mode": self.mode,
            "focus_ids": list(self.focus_ids), "kept": list(self.kept),
            "logical": list(self.logical), "physical": list(self.physical),
            "seq_len": self.seq_len, "group": self.group, "token_bytes": self.token_bytes,
        }


class Tracker(ABC):
    """A request the plugin follows, whichever runner and whatever it reads.

    ``label`` names it in the read log (a request without one keeps no log);
    ``masking``: whether its steps are meant to read less than everything (DA-nm's are
    not); ``follows_output``: whether its kept blocks depend on its output tokens (the
    V2 processor copies those to the host only then)."""

    follows_output = True

    def __init__(self, label: str | None, masking: bool, prompt_len: int) -> None:
        self.label = label
        self.masking = masking
        self.prompt_len = prompt_len
        self.reads: list[ReadRecord] = []
        self.noted: dict[int, str] = {}

    @abstractmethod
    def kept_blocks(self, length: int, block_size: int) -> tuple[int, ...] | None:
        """The logical blocks the decode step that sees ``length`` positions may read;
        None when it reads everything."""

    @abstractmethod
    def _describe(self, length: int, block_size: int) -> tuple[str, tuple[int, ...],
                                                                tuple[int, ...]]:
        """``(mode, focus ids, kept blocks)`` of the step, for its read record."""

    @property
    def edits_logits(self) -> bool:
        return False

    def process_logits(self, row: Tensor) -> Tensor:
        return row

    def record(self, length: int, blocks: tuple[int, ...], physical_ids: Tensor, seq_len: int,
               group: int, token_bytes: int, block_size: int) -> None:
        """Log what the builder handed the kernel for the step that sees ``length``
        positions. Only labelled requests keep a log: a served request keeps nothing."""
        if self.label is None:
            return
        mode, focus_ids, kept = self._describe(length, block_size)
        self.reads.append(ReadRecord(
            step=self.step_of(length), length=length, mode=mode, focus_ids=focus_ids,
            kept=kept, logical=blocks, physical_ids=physical_ids, seq_len=seq_len,
            group=group, token_bytes=token_bytes,
        ))

    def step_of(self, length: int) -> int:
        """The output token a decode step that sees ``length`` positions produces."""
        return length - self.prompt_len

    def note(self, length: int, reason: str) -> None:
        """The decode step that sees ``length`` positions was handed every block, and
        why (the first reason a KV-cache group gives for that step is kept)."""
        self.noted.setdefault(self.step_of(length), reason)


def chunk_ids_of(prompt_ids: Sequence[int] | None, layout: Layout) -> list[list[int]] | None:
    """The token ids of each chunk span of ``prompt_ids``; None when the prompt is not
    there or not the one the layout describes."""
    if prompt_ids is None or len(prompt_ids) != layout.prompt_len:
        return None
    return [[int(t) for t in prompt_ids[s.start : s.end]] for s in layout.chunks]


class RequestTracker(Tracker):
    """A DA request's protocol state, kept in step with vLLM's output list.

    ``vocab`` / ``find_vocab`` / ``opening_vocab``: the served tokenizer's constraint
    tables, where the spec turns that constraint on. ``chunk_ids``: the prompt's chunk
    spans, to rebuild the chunk texts find phrases are looked up in; a runner that hands
    them over later sets them before the first token (``give_chunks``). Without them,
    every find is declined (``find, but the reader has no chunk texts``), as a reader
    without texts does."""

    def __init__(self, spec: DASpec, output_ids: Sequence[int], tokenizer: Any,
                 vocab: FocusVocab | None = None, find_vocab: FindVocab | None = None,
                 opening_vocab: OpeningVocab | None = None,
                 chunk_ids: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__(spec.label, spec.masking, spec.layout.prompt_len)
        self.spec = spec
        self.output_ids = output_ids
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.find_vocab = find_vocab
        self.opening_vocab = opening_vocab
        self.chunk_ids = chunk_ids
        self.detok = Detokenizer(tokenizer)
        self.fed = 0
        self.text = ""
        self._state: DAState | None = None

    @property
    def wants_chunks(self) -> bool:
        """Whether the runner should still hand over the prompt's chunk tokens."""
        return self._state is None and self.chunk_ids is None

    def give_chunks(self, chunk_ids: Sequence[Sequence[int]]) -> None:
        if self._state is not None:
            raise RuntimeError("the chunk tokens came after the request's first token")
        if len(chunk_ids) != self.spec.layout.n_chunks:
            raise ValueError(f"{len(chunk_ids)} chunk spans for {self.spec.layout.n_chunks}")
        self.chunk_ids = chunk_ids

    @property
    def state(self) -> DAState:
        """The request's DA state (``declattn.da.state``, the one ``DASession`` drives),
        built on first use from the chunk texts the prompt's spans decode to."""
        if self._state is None:
            spec = self.spec
            texts = None
            if self.chunk_ids is not None:
                texts = [decode(self.tokenizer, list(ids)) for ids in self.chunk_ids]
            ids_on, find_on = spec.constraints()
            self._state = DAState(
                spec.layout, texts, line_start=spec.line_start,
                scaffold_local=spec.scaffold_local, focus_form=spec.focus,
                focus_vocab=self.vocab if ids_on else None,
                find_vocab=self.find_vocab if find_on else None,
                opening_vocab=self._tag_vocab() if spec.open_tag else None,
                answer_vocab=self._tag_vocab() if spec.answer_after_find else None,
                end_ids=self.tokenizer.all_special_ids if spec.require_answer else (),
            )
        return self._state

    def _tag_vocab(self) -> OpeningVocab:
        if self.opening_vocab is None:
            self.opening_vocab = OpeningVocab.from_tokenizer(self.tokenizer)
        return self.opening_vocab

    @property
    def reader(self) -> TagReader:
        return self.state.reader

    @property
    def n_out(self) -> int:
        """Output tokens vLLM has appended so far (placeholders of async scheduling,
        negative ids, are not tokens yet)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] < 0:
            n -= 1
        return n

    def sync(self) -> None:
        """Feed the DA state every output token it has not seen."""
        state = self.state
        n = self.n_out
        while self.fed < n:
            token = int(self.output_ids[self.fed])
            text = self.detok.add(token)
            self.text += text
            state.feed(token, text)
            self.fed += 1

    def scope(self) -> Scope:
        self.sync()
        return self.state.scope()

    def kept_blocks(self, length: int, block_size: int) -> tuple[int, ...] | None:
        """None also for DA-nm, and for a length that is not this request's next step."""
        if not self.spec.masking:
            return None
        if length != self.spec.layout.prompt_len + self.n_out:
            return None  # not the step we track (a recompute, a draft): read everything
        return tuple(self.scope().kept_blocks(length, block_size))

    def _describe(self, length: int, block_size: int) -> tuple[str, tuple[int, ...],
                                                                tuple[int, ...]]:
        scope = self.scope()
        return str(scope.mode), scope.focus_ids, tuple(scope.kept_blocks(length, block_size))

    @property
    def edits_logits(self) -> bool:
        spec = self.spec
        return (bool(spec.force) or spec.require_answer or spec.needs_tag_vocab
                or any(spec.constraints()))

    def process_logits(self, row: Tensor) -> Tensor:
        """Forced tokens first (teacher forcing), else the spec's constraints."""
        self.sync()
        k = self.n_out
        if k < len(self.spec.force):
            out = torch.full_like(row, float("-inf"))
            out[self.spec.force[k]] = 0.0
            return out
        state = self.state
        return constrain(state.constraints, row, self.reader.pending, k, state.banned_ids())
