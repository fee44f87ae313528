"""The block allocator: which physical KV blocks are free, held, or cached for reuse.

A block is in exactly one of three states:

- free: holds nothing anyone wants;
- held: in the table of at least one sequence (``refs[b]`` of them);
- cached: held by no sequence, but keeping the K/V of a full prompt block that a later
  prompt with the same tokens may take over instead of computing it again.

A full block gets a content address when its K/V is complete: a digest of (the previous
block's address, this block's token ids and their regions), so an address names the
whole prefix up to the block's end, never just the block. A new sequence takes the
longest chain of addressed blocks matching its prompt by reference (``share``); it never
writes into them (they are full, and a sequence writes only past its own length).
Blocks that drop to zero references stay cached and are evicted least recently used
when an allocation needs room, so a cached block is as good as free for admission:
``n_available`` counts both, and ``PoolExhausted`` is raised exactly when free plus
cached blocks cannot cover a request.

Digests are BLAKE2b, not Python's ``hash``: a server takes token ids from anyone, and a
crafted collision would hand one client another's K/V.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_DIGEST_BYTES = 16


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than a request needs; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


def block_digests(
    token_ids: Sequence[int], regions: Sequence[int] | None, block_size: int
) -> list[bytes]:
    """Content addresses of the full blocks of ``token_ids``, each chained to the last.

    ``regions`` (one per token, or ``None``) enter the address for models whose K/V of
    a token depends on the region it sits in (``declattn_tiny``'s segment embedding).
    """
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    ids = np.asarray(token_ids[: n_full * block_size], dtype=np.int64).reshape(n_full, -1)
    regs = None
    if regions is not None:
        regs = np.asarray(regions[: n_full * block_size], dtype=np.int64).reshape(n_full, -1)
    out: list[bytes] = []
    parent = b""
    for i in range(n_full):
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(ids[i].tobytes())
        if regs is not None:
            h.update(regs[i].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class BlockAllocator:
    """Free map, reference counts and the prefix cache of one pool of ``num_blocks``."""

    def __init__(self, num_blocks: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        # The free map is a bitmap: ordered by block id by construction, and its runs
        # of free blocks come out of one vectorised pass.
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._n_free = num_blocks
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # Cached blocks no sequence holds, least recently used first: eviction order.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.hits = 0  # blocks found by share, over the run
        self.lookups = 0  # blocks share was asked for

    # -- queries -------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Blocks holding nothing."""
        return self._n_free

    @property
    def n_cached_idle(self) -> int:
        """Cached blocks no sequence holds (evictable on demand)."""
        return len(self._idle)

    @property
    def n_available(self) -> int:
        """What an allocation can get: free blocks plus evictable cached ones."""
        return self._n_free + len(self._idle)

    @property
    def n_cached(self) -> int:
        """Blocks with a content address, held or not."""
        return len(self._digest_of)

    def refs(self, block: int) -> int:
        return int(self._refs[block])

    def is_cached(self, block: int) -> bool:
        return block in self._digest_of

    # -- allocation ----------------------------------------------------------------
    def take(self, n: int, successor: int | None) -> list[int]:
        """``n`` blocks for one sequence, referenced once each; all or nothing.

        Free blocks first (extending ``successor`` in place, else the best-fitting free
        run), and only then the least recently used cached blocks, which lose their
        address: K/V computed once is kept as long as the pool can afford it.
        """
        if n > self.n_available:
            raise PoolExhausted(n, self.n_available)
        while self._n_free < n:
            self._evict(next(iter(self._idle)))
        chosen = self._choose(successor, n)
        self._is_free[chosen] = False
        self._n_free -= len(chosen)
        self._refs[chosen] = 1
        return chosen

    def cached_prefix(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, have cached blocks (the chain stops at
        the first miss); looks only, references nothing."""
        if not self.caching:
            return 0
        n = 0
        for d in digests:
            if d not in self._block_of:
                break
            n += 1
        return n

    def share(self, digests: Sequence[bytes]) -> list[int]:
        """Reference the cached blocks of ``digests`` (each must be cached: see
        ``cached_prefix``); returns their ids, held from now on."""
        found = [self._block_of[d] for d in digests]
        for block in found:
            self._idle.pop(block, None)
            self._refs[block] += 1
        return found

    def count_lookup(self, asked: int, found: int) -> None:
        """Count one prefix lookup: ``asked`` blocks looked for, ``found`` taken."""
        self.lookups += asked
        self.hits += found

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free, or
        cached-idle if they hold an addressed prefix (most recently used last)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._digest_of:
                self._idle[block] = None
            else:
                self._is_free[block] = True
                self._n_free += 1

    def register(self, block: int, digest: bytes) -> None:
        """Give a full, held block its content address. A digest already cached elsewhere
        (two sequences computed the same prefix at once) keeps its first block; this one
        stays anonymous and is freed as usual."""
        if not self.caching or digest in self._block_of or block in self._digest_of:
            return
        self._block_of[digest] = block
        self._digest_of[block] = digest

    def _evict(self, block: int) -> None:
        del self._idle[block]
        del self._block_of[self._digest_of.pop(block)]
        self._is_free[block] = True
        self._n_free += 1

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
