"""The weight arena: exact copies at aligned starts, a clear error when full, and (on
Linux with transparent huge pages offered) memory that asks the kernel for huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from declattn.engine.quant.arena import ALIGN, WeightArena, huge_pages_offered, slot_bytes


def test_placed_tensors_are_exact_copies_at_aligned_starts():
    ts = [torch.randint(0, 256, (n, 7), dtype=torch.uint8) for n in (1, 5, 33)]
    ts.append(torch.randn(3, 5))
    arena = WeightArena(sum(slot_bytes(t.numel() * t.element_size()) for t in ts))
    placed = [arena.place(t) for t in ts]
    for t, p in zip(ts, placed, strict=True):
        assert torch.equal(t, p) and p.dtype == t.dtype and p.data_ptr() % ALIGN == 0
        assert p.data_ptr() != t.data_ptr()
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in placed)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no two overlap
    assert arena.free == 0


def test_a_full_arena_says_so():
    arena = WeightArena(64)
    arena.place(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight arena full: 1 bytes do not fit in 0 left"):
        arena.place(torch.zeros(1, dtype=torch.uint8))


def _mapping(address: int) -> tuple[str, list[str]]:
    """The mapping holding ``address``: its header line and the kernel's VmFlags."""
    header = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            header = line if lo <= address < hi else ""
        elif header and head == "VmFlags:":
            return header, line.split()[1:]
    raise AssertionError(f"{address:#x} is not mapped")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="no /proc (not Linux)")
def test_the_arena_is_private_memory_that_asks_for_huge_pages_where_offered():
    arena = WeightArena(6 * 2**20)
    t = arena.place(torch.ones(4 * 2**20, dtype=torch.uint8))
    header, flags = _mapping(t.data_ptr())
    # private and anonymous: a shared one would be shmem (no path but "/dev/zero"), whose
    # huge pages follow shmem_enabled, not the setting huge_pages_offered reads
    assert header.split()[1] == "rw-p" and len(header.split()) == 5, header
    assert arena.huge_pages == huge_pages_offered()
    assert ("hg" in flags) == arena.huge_pages  # MADV_HUGEPAGE
