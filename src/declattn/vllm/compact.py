"""Compacting block-table rows: the stock paged kernel then reads only the kept blocks.

A decode row's block table lists the KV blocks of its sequence in logical order and its
sequence length says how many positions to read. Rewriting the row to the kept blocks
only (the newest one last) and shortening the length to match makes any paged kernel
read just those pages: it never learns that the sequence is longer. Nothing is moved or
evicted; the next step can read everything again. Positions are untouched (rotary
embedding is applied before K is cached, and the new token's slot is written through the
slot mapping, which this does not change).

Only whole blocks are kept, and every kept block except the newest is full, so the new
length is ``(kept - 1) * block_size`` plus the newest block's fill.

Everything the rewrite needs on the host (which rows, which logical blocks, the new
lengths) is known there already: the scope and the step's CPU lengths. So the work on
the device is one gather for all DA rows and two scatters, fed by index tensors copied
host-to-device without waiting; nothing is read back. The physical block ids handed to
the kernel stay on the device (``Compacted.physical``) until someone asks for them.

The input tensors may be shared between KV-cache groups and with the runner's
persistent buffers, so they are never written: the caller gets new ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Compacted:
    block_table: Tensor  # same shape and device as the input
    seq_lens: Tensor  # same shape and device as the input
    rows: tuple[int, ...]  # the compacted rows, in the order of ``physical``'s rows
    lengths: dict[int, int]  # row -> new sequence length
    counts: dict[int, int]  # row -> number of kept blocks
    physical: Tensor  # [len(rows), max kept] block ids handed to the kernel, on the device

    def physical_of(self, row: int) -> Tensor:
        """The block ids of ``row``'s compacted table row (a device tensor, not read back)."""
        i = self.rows.index(row)
        return self.physical[i, : self.counts[row]]


def compacted_length(length: int, n_kept: int, block_size: int) -> int:
    """The sequence length of a row cut to ``n_kept`` blocks, the newest one last."""
    newest = (length - 1) // block_size
    return (n_kept - 1) * block_size + (length - newest * block_size)


def _check(row: int, blocks: Sequence[int], length: int, block_size: int, width: int) -> None:
    newest = (length - 1) // block_size
    if not blocks or blocks[-1] != newest or blocks[0] < 0:
        raise ValueError(f"row {row}: kept blocks {list(blocks)} must end with block {newest}")
    if any(a >= b for a, b in zip(blocks, blocks[1:], strict=False)):
        raise ValueError(f"row {row}: kept blocks must be sorted and distinct")
    if newest >= width:
        raise ValueError(f"row {row}: block {newest} is past the table's {width} columns")


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting for it: pinned, then copied
    asynchronously (the caching host allocator keeps the pinned copy alive until the
    copy has run)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def compact_rows(
    block_table: Tensor,
    seq_lens: Tensor,
    lengths: Mapping[int, int],
    kept: Mapping[int, Sequence[int]],
    block_size: int,
) -> Compacted:
    """New block table and lengths with each row in ``kept`` cut to its kept blocks.

    ``lengths[row]`` is the row's current sequence length (from the step's CPU lengths);
    ``kept[row]`` lists logical block ids, sorted, ending with the block of the newest
    position (``length - 1``). Rows not in ``kept`` are copied unchanged.
    """
    width = block_table.shape[1]
    rows = tuple(kept)
    blocks = [[int(b) for b in kept[r]] for r in rows]
    for r, bl in zip(rows, blocks, strict=True):
        _check(r, bl, int(lengths[r]), block_size, width)
    counts = {r: len(bl) for r, bl in zip(rows, blocks, strict=True)}
    new_lengths = {r: compacted_length(int(lengths[r]), counts[r], block_size) for r in rows}
    table = block_table.clone()
    lens = seq_lens.clone()
    if not rows:
        empty = block_table.new_zeros((0, 0))
        return Compacted(table, lens, rows, new_lengths, counts, empty)
    n_max = max(counts.values())
    cols = torch.zeros((len(rows), n_max), dtype=torch.long)
    for i, bl in enumerate(blocks):
        cols[i, : len(bl)] = torch.tensor(bl, dtype=torch.long)
    valid = torch.arange(n_max).unsqueeze(0) < torch.tensor([counts[r] for r in rows]).unsqueeze(1)
    device = block_table.device
    rows_d = to_device(torch.tensor(rows, dtype=torch.long), device)
    cols_d = to_device(cols, device)
    valid_d = to_device(valid, device)
    lens_d = to_device(torch.tensor([new_lengths[r] for r in rows], dtype=seq_lens.dtype), device)
    # one gather for every DA row: [rows, n_max] physical ids, padding zeroed
    physical = block_table.index_select(0, rows_d).gather(1, cols_d)
    physical = torch.where(valid_d, physical, torch.zeros_like(physical))
    new_rows = torch.zeros((len(rows), width), dtype=block_table.dtype, device=device)
    new_rows[:, :n_max] = physical
    table.index_copy_(0, rows_d, new_rows)
    lens.index_copy_(0, rows_d, lens_d)
    return Compacted(table, lens, rows, new_lengths, counts, physical)
