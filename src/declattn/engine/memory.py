"""The memory a new allocation may take, so a KV pool that cannot fit is refused at once.

A KV pool is zero-filled, and so wholly resident, when it is made. One larger than the
memory left gets the process killed by the kernel's OOM killer (the throughput bench
asked for 16 x 30K-token pools and was), with no word of why. Checking the pool's bytes
against ``MemAvailable`` first turns that into a one-line error.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The kernel's estimate of memory a process can take without swapping
    (``MemAvailable``); ``None`` where there is no ``/proc/meminfo`` (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


class MemoryShortage(ValueError):
    """An allocation asked for more than the memory available."""


def check_fits(what: str, n_bytes: int, fix: str, meminfo: Path = MEMINFO) -> None:
    """Raise ``MemoryShortage`` naming ``what`` and ``fix`` when ``n_bytes`` exceed the
    memory available now; unknown availability passes."""
    free = available_bytes(meminfo)
    if free is not None and n_bytes > free:
        raise MemoryShortage(
            f"{what} needs {n_bytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
            f"of memory available: {fix}"
        )
