"""Scope: a layout plus the current mode, as the token spans and KV blocks to read.

This is the one place where a declared mode becomes positions. The engine asks it
once per decode step, so it works on spans and block ranges arithmetically and never
walks positions one by one (a 128K-token context is 8K blocks, not 128K checks).

What each mode keeps (always: the sink, the question window, and the response, i.e.
every position from the end of the prompt on):

- GLOBAL: everything;
- FOCUS: the always-kept parts plus the named chunks;
- LOCAL and ANSWER: the always-kept parts only; an answer opened inside a focus block
  also keeps that focus's chunks (``focus_ids``).

DESIGN.md's table says local keeps the whole scaffold; we follow the issue, which says
sink + question window + response, so text between chunks is not read in local.
"""

from __future__ import annotations

from dataclasses import dataclass

from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class StepCount:
    """Attended KV positions for one decode step, DA against vanilla attention."""

    logical: int  # kept tokens
    physical: int  # kept blocks * block size
    vanilla_logical: int  # every position
    vanilla_physical: int  # every block * block size

    @classmethod
    def full(cls, length: int, block_size: int = DEFAULT_BLOCK_SIZE) -> StepCount:
        """A step that reads every position (vanilla attention, DA-nm)."""
        physical = -(-length // block_size) * block_size
        return cls(length, physical, length, physical)


def _merge(spans: list[Span]) -> list[Span]:
    """Sorted, with overlapping or touching spans joined and empty ones dropped."""
    out: list[Span] = []
    for s in sorted(spans):
        if s.start == s.end:
            continue
        if out and s.start <= out[-1].end:
            if s.end > out[-1].end:
                out[-1] = Span(out[-1].start, s.end)
        else:
            out.append(s)
    return out


def _check_sizes(length: int, block_size: int) -> None:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


@dataclass(frozen=True)
class Scope:
    """What the next decode step may read: ``layout`` under ``mode`` and ``focus_ids``.

    ``focus_ids`` are 1-based chunk ids: required in FOCUS, allowed in ANSWER (an answer
    written inside a focus block), empty otherwise.
    """

    layout: Layout
    mode: Mode = Mode.GLOBAL
    focus_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "focus_ids", tuple(int(i) for i in self.focus_ids))
        ids = self.focus_ids
        if self.mode is Mode.FOCUS:
            if not ids:
                raise ValueError("focus mode needs at least one chunk id")
            if len(set(ids)) != len(ids):
                raise ValueError(f"duplicate focus ids {ids}")
        elif ids and self.mode is not Mode.ANSWER:
            raise ValueError(
                f"focus ids {ids} given in {self.mode} mode; only focus and answer have ids"
            )
        if ids:
            bad = [i for i in ids if not 1 <= i <= self.layout.n_chunks]
            if bad:
                raise ValueError(
                    f"focus ids {bad} not in the layout (chunks 1..{self.layout.n_chunks})"
                )

    def kept_spans(self, length: int) -> list[Span]:
        """Token spans read at a step that sees positions ``[0, length)``; sorted, merged."""
        _check_sizes(length, 1)
        if self.mode is Mode.GLOBAL:
            return [Span(0, length)]
        lay = self.layout
        spans = [lay.sink, lay.question]
        if length > lay.prompt_len:
            spans.append(Span(lay.prompt_len, length))
        spans.extend(lay.chunk(i) for i in self.focus_ids)  # a focus, or an answer in one
        return _merge([s.clip(length) for s in spans])

    def kept_block_ranges(self, length: int, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Span]:
        """Kept logical blocks as merged half-open ranges of block ids.

        Spans are rounded outward to whole blocks, and the block holding the newest
        token (``length - 1``) is always kept, since the step's own query sits there.
        """
        _check_sizes(length, block_size)
        ranges = [
            Span(s.start // block_size, (s.end - 1) // block_size + 1)
            for s in self.kept_spans(length)
        ]
        newest = (length - 1) // block_size
        ranges.append(Span(newest, newest + 1))
        return _merge(ranges)

    def kept_blocks(self, length: int, block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
        """Logical block ids (``position // block_size``) read at this step, sorted. They
        depend on ``length`` only through the newest block: a span clipped to ``length``
        reaches that block or stops before it, and that block is always kept."""
        out: list[int] = []
        for r in self.kept_block_ranges(length, block_size):
            out.extend(range(r.start, r.end))
        return out

    def count(self, length: int, block_size: int = DEFAULT_BLOCK_SIZE) -> StepCount:
        """Attended positions at a step that sees ``length`` positions."""
        logical = sum(len(s) for s in self.kept_spans(length))
        blocks = sum(len(r) for r in self.kept_block_ranges(length, block_size))
        full = StepCount.full(length, block_size)
        return StepCount(logical, blocks * block_size, full.vanilla_logical, full.physical)
