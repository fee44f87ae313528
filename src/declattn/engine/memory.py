"""The memory a new allocation may take, so a KV pool that cannot fit is refused at once.

A CPU pool is zero-filled lazily (``torch.zeros`` maps pages on first write), so a pool
larger than the machine is created without complaint and the process is killed by the
kernel's OOM killer minutes later, when the requests have filled it. Checking the pool's
bytes against ``MemAvailable`` when it is created turns that into a one-line error.
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
