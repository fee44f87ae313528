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

The input tensors may be shared between KV-cache groups and with the runner's
persistent buffers, so they are never written: the caller gets new ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Compacted:
    block_table: Tensor  # same shape and device as the input
    seq_lens: Tensor  # same shape and device as the input
    lengths: dict[int, int]  # row -> new sequence length
    physical: dict[int, tuple[int, ...]]  # row -> KV block ids handed to the kernel


def compacted_length(length: int, n_kept: int, block_size: int) -> int:
    """The sequence length of a row cut to ``n_kept`` blocks, the newest one last."""
    newest = (length - 1) // block_size
    return (n_kept - 1) * block_size + (length - newest * block_size)


def compact_rows(
    block_table: Tensor,
    seq_lens: Tensor,
    lengths: Mapping[int, int],
    kept: Mapping[int, Sequence[int]],
    block_size: int,
) -> Compacted:
    """New block table and lengths with each row in ``kept`` cut to its kept blocks.

    ``lengths[row]`` is the row's current sequence length; ``kept[row]`` lists logical
    block ids, sorted, ending with the block of the newest position (``length - 1``).
    Rows not in ``kept`` are copied unchanged.
    """
    table = block_table.clone()
    lens = seq_lens.clone()
    table_cpu = block_table.cpu()
    new_lengths: dict[int, int] = {}
    physical: dict[int, tuple[int, ...]] = {}
    for row, blocks in kept.items():
        length = int(lengths[row])
        newest = (length - 1) // block_size
        blocks = [int(b) for b in blocks]
        if not blocks or blocks[-1] != newest or blocks[0] < 0:
            raise ValueError(f"row {row}: kept blocks {blocks} must end with block {newest}")
        if any(a >= b for a, b in zip(blocks, blocks[1:], strict=False)):
            raise ValueError(f"row {row}: kept blocks must be sorted and distinct")
        ids = table_cpu[row, blocks]
        n = len(blocks)
        table[row, :n] = ids.to(table.device)
        table[row, n:] = 0
        new_lengths[row] = compacted_length(length, n, block_size)
        lens[row] = new_lengths[row]
        physical[row] = tuple(int(x) for x in ids)
    return Compacted(block_table=table, seq_lens=lens, lengths=new_lengths, physical=physical)
