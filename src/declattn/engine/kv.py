"""Paged KV storage: fixed-size blocks, per-sequence block tables over a ``BlockAllocator``.

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

from declattn.engine.blocks import BlockAllocator, PoolExhausted
from declattn.engine.memory import check_fits
from declattn.engine.native import store_op

__all__ = [
    "KVCache", "KVConfig", "PoolExhausted", "PoolStats", "SequenceKeys", "inverse_table"
]


def inverse_table(table: np.ndarray) -> np.ndarray:
    """Logical index of each physical block id up to the table's largest (-1: not in it)."""
    inverse = np.full(int(table.max()) + 1 if table.size else 0, -1, dtype=np.int64)
    inverse[table] = np.arange(table.size)
    return inverse


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

    @property
    def pool_bytes(self) -> int:
        """K + V bytes of the whole pool, every layer."""
        return self.n_layers * self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class PoolStats:
    """A KV pool's size and occupancy at one moment (for ``/metrics``, admission, tests).

    ``cached`` counts blocks no sequence holds that keep a cached prefix's K/V; they are
    as good as free for admission (evicted on demand), so ``free`` includes them.
    """

    num_blocks: int
    free: int
    block_size: int
    bytes_per_token: int
    cached: int = 0
    cache_hits: int = 0
    """Prompt blocks taken over from the prefix cache, over the pool's life."""
    cache_lookups: int = 0
    """Prompt blocks looked up in the prefix cache, over the pool's life."""

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.free

    @classmethod
    def empty(cls, num_blocks: int, block_size: int) -> PoolStats:
        """A pool not allocated yet (all free; its byte size unknown until it is)."""
        return cls(num_blocks, num_blocks, block_size, 0)


class KVCache:
    """Per-layer K/V block pools plus the block tables that map positions to slots.

    Position ``p`` of sequence ``s`` lives in physical block ``table[s][p // block_size]``
    at row ``block * block_size + p % block_size`` of every layer's pools.
    """

    def __init__(self, config: KVConfig, *, prefix_caching: bool = True) -> None:
        self.config = config
        if torch.device(config.device).type == "cpu":
            check_fits(
                f"a KV pool of {config.num_blocks:,} blocks of {config.block_size} tokens",
                config.pool_bytes,
                "ask for fewer KV blocks or tokens (--kv-blocks, kv_tokens), or fewer or "
                "shorter requests at once",
            )
        shape = (config.n_kv_heads, config.num_blocks * config.block_size, config.head_dim)
        self.k: list[Tensor] = [
            torch.zeros(shape, dtype=config.dtype, device=config.device)
            for _ in range(config.n_layers)
        ]
        self.v: list[Tensor] = [
            torch.zeros(shape, dtype=config.dtype, device=config.device)
            for _ in range(config.n_layers)
        ]
        # a step's new rows of a CPU pool are stored in one native call (kv_store.cpp)
        self._store = store_op() if torch.device(config.device).type == "cpu" else None
        self.blocks = BlockAllocator(config.num_blocks, caching=prefix_caching)
        self._tables: dict[int, list[int]] = {}
        # each table as a read-only int64 array, made at the first ask after it changed:
        # every decode step asks for every running sequence's, twice
        self._arrays: dict[int, np.ndarray] = {}

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
        """Blocks an allocation can get: free ones and evictable cached ones."""
        return self.blocks.n_available

    def stats(self) -> PoolStats:
        c = self.config
        b = self.blocks
        return PoolStats(
            c.num_blocks, self.num_free_blocks, c.block_size, c.bytes_per_token,
            cached=b.n_cached_idle, cache_hits=b.hits, cache_lookups=b.lookups,
        )

    @property
    def blocks_in_use(self) -> int:
        """Blocks some sequence holds."""
        return self.config.num_blocks - self.num_free_blocks

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(self._tables)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """Physical block ids of a sequence, in logical order (empty if unknown)."""
        return tuple(self._tables.get(seq_id, ()))

    def block_array(self, seq_id: int) -> np.ndarray:
        """``block_table`` as an int64 array (read-only: the cache keeps it until the
        table changes)."""
        array = self._arrays.get(seq_id)
        if array is None:
            array = np.asarray(self._tables.get(seq_id, ()), dtype=np.int64)
            array.flags.writeable = False
            if seq_id in self._tables:
                self._arrays[seq_id] = array
        return array

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
        chosen = self.blocks.take(needed, table[-1] + 1 if table else None)
        self._set_table(seq_id, table + chosen)
        return tuple(chosen)

    def share_prefix(self, seq_id: int, digests: list[bytes], multiple: int = 1) -> int:
        """Start a new sequence's table with the cached blocks of the longest cached
        prefix of ``digests``, rounded down to a multiple of ``multiple`` blocks; returns
        how many blocks it took."""
        if self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        n = self.blocks.cached_prefix(digests) // multiple * multiple
        self.blocks.count_lookup(len(digests), n)
        self._set_table(seq_id, self.blocks.share(digests[:n]))
        return n

    def register(self, seq_id: int, index: int, digest: bytes) -> None:
        """Address logical block ``index`` of ``seq_id`` (now full and written) by
        ``digest``, so later prompts with the same prefix can share it."""
        self.blocks.register(self._tables[seq_id][index], digest)

    def _set_table(self, seq_id: int, table: list[int]) -> None:
        self._tables[seq_id] = table
        self._arrays.pop(seq_id, None)

    def free(self, seq_id: int) -> int:
        """Return a sequence's blocks to the pool; returns how many were freed."""
        table = self._tables.pop(seq_id, [])
        self._arrays.pop(seq_id, None)
        self.blocks.release(table)
        return len(table)

    def export_rows(self, seq_id: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """A copy of the K and V of ``seq_id``'s positions ``[start, stop)`` in every layer,
        on the CPU: ``[n_layers, n_kv_heads, stop - start, head_dim]`` each, the pools'
        dtype and bytes (the disk tier writes them)."""
        rows = self.slots(seq_id, start, stop)
        k = torch.stack([pool.index_select(1, rows) for pool in self.k])
        v = torch.stack([pool.index_select(1, rows) for pool in self.v])
        return k.cpu(), v.cpu()

    def import_rows(self, seq_id: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store ``export_rows``-shaped ``k``/``v`` at ``seq_id``'s positions from ``start``
        (its blocks must be allocated); the bytes land as they are."""
        rows = self.slots(seq_id, start, start + k.shape[2])
        for layer in range(self.config.n_layers):
            self.k[layer].index_copy_(1, rows, k[layer].to(self.config.device))
            self.v[layer].index_copy_(1, rows, v[layer].to(self.config.device))

    # -- writes --------------------------------------------------------------------
    def stores_natively(self) -> bool:
        """Whether ``write`` stores rows of the pools' dtype by the native kernel
        (``csrc/kv_store.cpp``), which a native layer runner calls itself."""
        return self._store is not None

    def write(self, layer: int, slots: Tensor | slice, k: Tensor, v: Tensor) -> None:
        """Store ``k``/``v`` (``[T, n_kv_heads, head_dim]``) at pool rows ``slots`` (an
        index tensor, or a slice for consecutive rows: a plain copy on the torch path)."""
        if self._store is not None and k.dtype == v.dtype == self.config.dtype:
            rows = slots if isinstance(slots, Tensor) else torch.arange(slots.start, slots.stop)
            self._store(self.k[layer], self.v[layer], k, v, rows)
            return
        if isinstance(slots, slice):
            self.k[layer][:, slots].copy_(k.transpose(0, 1))
            self.v[layer][:, slots].copy_(v.transpose(0, 1))
            return
        self.k[layer][:, slots, :] = k.transpose(0, 1).to(self.config.dtype)
        self.v[layer][:, slots, :] = v.transpose(0, 1).to(self.config.dtype)


class SequenceKeys:
    """Read access to one sequence's stored keys, block by block, for controllers that
    choose blocks from the keys themselves (Quest-style baselines). It hands out copies
    of whole blocks by logical index; the pools and tables stay the engine's."""

    def __init__(self, cache: KVCache, seq_id: int) -> None:
        self._cache, self._seq_id = cache, seq_id

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    @property
    def element_size(self) -> int:
        return self._cache.k[0].element_size()

    def blocks(self, layer: int, start: int, stop: int) -> Tensor:
        """Keys of logical blocks ``[start, stop)`` of ``layer`` as fp32
        ``[n_kv_heads, stop - start, block_size, head_dim]``."""
        pool = self._cache.k[layer]
        n_kv, _, dim = pool.shape
        bs = self.block_size
        phys = torch.from_numpy(self._cache.block_array(self._seq_id)[start:stop].copy())
        rows = (phys[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1).to(pool.device)
        return pool.index_select(1, rows).float().view(n_kv, stop - start, bs, dim)

