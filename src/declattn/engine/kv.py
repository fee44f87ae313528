"""Paged KV storage: fixed-size blocks, per-sequence block tables, a free-block bitmap.

The pools are laid out ``[n_kv_heads, num_blocks * block_size, head_dim]`` per layer so
that a run of physically consecutive blocks is a zero-copy slice in which each head's
rows are contiguous: decode attention can hand such a slice straight to a matmul and
read exactly the bytes of the blocks it keeps, nothing else. The allocator therefore
tries hard to give a sequence consecutive blocks. Stored KV never moves and positions
are never renumbered: a DA view only changes which blocks are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def inverse_table(table: np.ndarray) -> np.ndarray:
    """Logical index of each physical block id up to the table's largest (-1: not in it)."""
    inverse = np.full(int(table.max()) + 1 if table.size else 0, -1, dtype=np.int64)
    inverse[table] = np.arange(table.size)
    return inverse


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than a request needs; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


@dataclass(frozen=True)
class KVConfig:
    """Shape of the paged KV cache (one pool per layer for K, one for V)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "num_blocks", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVConfig.{name} must be positive")

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one position in one layer, all KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        """K + V bytes of one block in one layer."""
        return self.block_size * self.bytes_per_token


class KVCache:
    """Per-layer K/V block pools plus the block tables that map positions to slots.

    Position ``p`` of sequence ``s`` lives in physical block ``table[s][p // block_size]``
    at row ``block * block_size + p % block_size`` of every layer's pools.
    """

    def __init__(self, config: KVConfig) -> None:
        self.config = config
        shape = (config.n_kv_heads, config.num_blocks * config.block_size, config.head_dim)
        self.k: list[Tensor] = [
            torch.zeros(shape, dtype=config.dtype, device=config.device)
            for _ in range(config.n_layers)
        ]
        self.v: list[Tensor] = [
            torch.zeros(shape, dtype=config.dtype, device=config.device)
            for _ in range(config.n_layers)
        ]
        # The free list is a bitmap: ordered by block id by construction, and its runs
        # of free blocks come out of one vectorised pass.
        self._is_free = np.ones(config.num_blocks, dtype=bool)
        self._n_free = config.num_blocks
        self._tables: dict[int, list[int]] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._inverses: dict[int, np.ndarray] = {}

    # -- queries -------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def bytes_per_block(self) -> int:
        """K + V bytes of one block in one layer."""
        return self.config.bytes_per_block

    @property
    def num_free_blocks(self) -> int:
        return self._n_free

    @property
    def blocks_in_use(self) -> int:
        return self.config.num_blocks - self._n_free

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(self._tables)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """Physical block ids of a sequence, in logical order (empty if unknown)."""
        return tuple(self._tables.get(seq_id, ()))

    def block_array(self, seq_id: int) -> np.ndarray:
        """``block_table`` as an int64 array, built once per change of the table (a
        decode step at 128K tokens would otherwise convert 8K ids per step)."""
        arr = self._arrays.get(seq_id)
        if arr is None:
            arr = np.asarray(self._tables.get(seq_id, ()), dtype=np.int64)
            arr.flags.writeable = False
            self._arrays[seq_id] = arr
        return arr

    def block_inverse(self, seq_id: int) -> np.ndarray:
        """Logical index of each physical block of the sequence (-1 for blocks not in
        it), indexed by physical id up to the sequence's largest; cached like
        ``block_array``. Lets a plan name the logical blocks its pool reads cover."""
        inv = self._inverses.get(seq_id)
        if inv is None:
            inv = inverse_table(self.block_array(seq_id))
            inv.flags.writeable = False
            self._inverses[seq_id] = inv
        return inv

    def capacity(self, seq_id: int) -> int:
        """Token positions the sequence's blocks can hold."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def slots(self, seq_id: int, start: int, stop: int) -> Tensor:
        """Pool rows of positions ``[start, stop)`` (slot mapping), as an int64 tensor."""
        table = self._tables.get(seq_id, [])
        if not 0 <= start <= stop <= len(table) * self.block_size:
            raise ValueError(
                f"positions [{start}, {stop}) outside sequence {seq_id}'s "
                f"{len(table) * self.block_size} allocated slots"
            )
        bs = self.block_size
        pos = np.arange(start, stop)
        rows = self.block_array(seq_id)[pos // bs] * bs + pos % bs
        return torch.from_numpy(rows).to(self.config.device)

    # -- allocation ----------------------------------------------------------------
    def allocate(self, seq_id: int, total_tokens: int) -> tuple[int, ...]:
        """Grow ``seq_id``'s table to hold ``total_tokens`` positions; never shrinks.

        Atomic: if the pool cannot supply every block needed, raise ``PoolExhausted``
        and change nothing. Blocks are chosen to keep the sequence physically
        consecutive (fewer, longer runs for decode to read). Returns the new blocks.
        """
        if total_tokens < 0:
            raise ValueError("total_tokens must be >= 0")
        table = self._tables.get(seq_id, [])
        needed = -(-total_tokens // self.block_size) - len(table)
        if needed <= 0:
            self._tables.setdefault(seq_id, table)
            return ()
        if needed > self._n_free:
            raise PoolExhausted(needed, self._n_free)
        chosen = self._choose(table[-1] + 1 if table else None, needed)
        self._is_free[chosen] = False
        self._n_free -= len(chosen)
        self._tables[seq_id] = table + chosen
        self._arrays.pop(seq_id, None)
        self._inverses.pop(seq_id, None)
        return tuple(chosen)

    def _choose(self, successor: int | None, n: int) -> list[int]:
        """Pick ``n`` free blocks: extend the last block in place, else the best-fitting
        free run, else the longest runs first. Reads the free map only."""
        is_free = self._is_free
        chosen: list[int] = []
        if successor is not None:
            while len(chosen) < n and successor < is_free.size and is_free[successor]:
                chosen.append(successor)
                successor += 1
        rest = n - len(chosen)
        if rest == 0:
            return chosen
        padded = np.zeros(is_free.size + 2, dtype=np.int8)
        padded[1:-1] = is_free
        padded[[c + 1 for c in chosen]] = 0
        edges = np.diff(padded)
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fitting = np.flatnonzero(lengths >= rest)
        if fitting.size:
            best = fitting[np.lexsort((starts[fitting], lengths[fitting]))[0]]
            return chosen + list(range(int(starts[best]), int(starts[best]) + rest))
        for i in np.lexsort((starts, -lengths)):
            take = min(int(lengths[i]), rest)
            chosen.extend(range(int(starts[i]), int(starts[i]) + take))
            rest -= take
            if rest == 0:
                break
        return chosen

    def free(self, seq_id: int) -> int:
        """Return a sequence's blocks to the pool; returns how many were freed."""
        table = self._tables.pop(seq_id, [])
        self._arrays.pop(seq_id, None)
        self._inverses.pop(seq_id, None)
        self._is_free[table] = True
        self._n_free += len(table)
        return len(table)

    # -- writes --------------------------------------------------------------------
    def write(self, layer: int, slots: Tensor | slice, k: Tensor, v: Tensor) -> None:
        """Store ``k``/``v`` (``[T, n_kv_heads, head_dim]``) at pool rows ``slots`` (an
        index tensor, or a slice for consecutive rows: a plain copy)."""
        if isinstance(slots, slice):
            self.k[layer][:, slots].copy_(k.transpose(0, 1))
            self.v[layer][:, slots].copy_(v.transpose(0, 1))
            return
        self.k[layer][:, slots, :] = k.transpose(0, 1).to(self.config.dtype)
        self.v[layer][:, slots, :] = v.transpose(0, 1).to(self.config.dtype)
