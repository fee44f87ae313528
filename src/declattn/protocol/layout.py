"""Token spans of a rendered DA prompt.

The layout is the one fact every path shares (run, serve, eval, replay): which token
positions hold the sink, each magic chunk, and the question window. Scopes are
computed from it, never from text, so the engine needs no tokenizer to apply a mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Span:
    """Half-open range of token positions ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad span [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def clip(self, length: int) -> Span:
        """The part of this span below ``length``."""
        return Span(min(self.start, length), min(self.end, length))


SCAFFOLD, QUESTION, RESPONSE = 0, -1, -2
"""Region ids of the positions outside every chunk (see ``Layout.regions``)."""


@dataclass(frozen=True)
class Layout:
    """Where the parts of a DA prompt sit, in token positions.

    ``chunks[i]`` is the body of magic chunk ``i + 1`` (chunk ids start at 1).
    """

    prompt_len: int
    sink: Span
    chunks: tuple[Span, ...]
    question: Span

    def __post_init__(self) -> None:
        parts = [self.sink, *self.chunks, self.question]
        if any(s.end > self.prompt_len for s in parts):
            raise ValueError("layout span beyond the prompt length")
        if self.question.end != self.prompt_len:
            raise ValueError("question window must end at the end of the prompt")
        for a, b in zip(self.chunks, self.chunks[1:], strict=False):
            if a.end > b.start:
                raise ValueError("chunk spans overlap or are out of order")
        if self.chunks and self.sink.end > self.chunks[0].start:
            raise ValueError("the sink overlaps chunk 1: chunk text would always be read")

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def chunk(self, chunk_id: int) -> Span:
        """The span of chunk ``chunk_id`` (1-based)."""
        if not 1 <= chunk_id <= len(self.chunks):
            raise KeyError(f"no magic chunk {chunk_id} (have 1..{len(self.chunks)})")
        return self.chunks[chunk_id - 1]

    def regions(self, start: int, stop: int) -> list[int]:
        """The region of each position in ``[start, stop)``: chunk id (>= 1) inside a
        chunk, ``QUESTION`` in the question window, ``RESPONSE`` from the end of the
        prompt on, ``SCAFFOLD`` elsewhere.

        Models that mix a token's neighbours into it (``declattn_tiny``) never mix across
        a region boundary: a chunk must look the same wherever it sits in the prompt.
        """
        out = []
        k = 0
        for p in range(start, stop):
            while k < len(self.chunks) and self.chunks[k].end <= p:
                k += 1
            if p >= self.prompt_len:
                out.append(RESPONSE)
            elif k < len(self.chunks) and self.chunks[k].start <= p:
                out.append(k + 1)
            elif self.question.start <= p:
                out.append(QUESTION)
            else:
                out.append(SCAFFOLD)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_len": self.prompt_len,
            "sink": [self.sink.start, self.sink.end],
            "chunks": [[s.start, s.end] for s in self.chunks],
            "question": [self.question.start, self.question.end],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(
            prompt_len=int(d["prompt_len"]),
            sink=Span(*d["sink"]),
            chunks=tuple(Span(*c) for c in d["chunks"]),
            question=Span(*d["question"]),
        )
