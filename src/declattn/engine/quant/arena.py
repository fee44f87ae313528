"""One run of anonymous memory for a model's GGUF blocks, in huge pages where the OS
allows them.

Why: a decode step reads every weight matrix once, one after another, and its time is
those bytes over the bandwidth; where the blocks sit changes that bandwidth. Loaded as
they are, the K-format matrices (Q4_K, Q6_K: kept in the file's layout) were views of
the packed cache file's mapping (page-cache pages), and read slower than the same bytes
copied out into anonymous memory, and 2 MB pages read faster than torch's own heap
(4 KB pages) once two threads share the memory bus. Fewer, larger pages mean fewer TLB
misses, each a nested page walk in a virtual machine.

The arena is one private anonymous ``mmap`` with ``MADV_HUGEPAGE`` from its first 2 MB
boundary on (Linux with transparent huge pages set to ``always`` or ``madvise``;
elsewhere it is plain anonymous memory, which keeps the first of the two gains). Each
tensor starts on a 64-byte boundary, as the kernels' vector loads want.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import Tensor

HUGE_PAGE = 2 * 2**20
ALIGN = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def slot_bytes(nbytes: int) -> int:
    """What a tensor of ``nbytes`` takes in the arena (its start stays 64-byte aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def huge_pages_offered() -> bool:
    """Whether this OS gives a region that asks for huge pages some (``[always]`` or
    ``[madvise]`` in the kernel's setting; ``[never]`` or no such file: no)."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


class WeightArena:
    """Room for ``nbytes`` of tensors (sum of ``slot_bytes``), filled by ``place``."""

    def __init__(self, nbytes: int) -> None:
        # private: a shared anonymous map is shmem, whose huge pages follow another setting
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=private)
        self._memory = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -self._memory.data_ptr() % HUGE_PAGE
        self.huge_pages = huge_pages_offered()  # the setting exists on Linux only
        if self.huge_pages:  # before first touch: faults then take whole 2 MB pages
            self._map.madvise(mmap.MADV_HUGEPAGE, start, len(self._map) - start)
        self._next, self._end = start, start + nbytes

    def place(self, t: Tensor) -> Tensor:
        """A copy of ``t`` (contiguous, CPU) in the arena's next slot."""
        n = t.numel() * t.element_size()
        if self._next + n > self._end:
            raise ValueError(f"weight arena full: {n} bytes do not fit in {self.free} left")
        raw = self._memory[self._next : self._next + n]
        self._next += slot_bytes(n)
        return raw.view(t.dtype).view(t.shape).copy_(t)

    @property
    def free(self) -> int:
        return self._end - self._next
