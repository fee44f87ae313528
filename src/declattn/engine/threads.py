"""How many threads torch should use on a CPU that other processes share.

Every torch op that runs in parallel ends at a barrier, so it finishes only when its
slowest thread does. When the machine has fewer idle cores than torch has threads, a
thread waits for a time slice and small ops (a norm, a rotary, a residual add) take
milliseconds instead of microseconds: on a 2-core machine with a load average of 7, a
SmolLM2 prefill chunk ran 10 times slower with 2 threads than with 1. One thread per
idle core avoids that; an idle machine still gets every core.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The one-minute load average, or ``None`` where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def suggest_threads(cores: int | None = None, load: float | None = None) -> int:
    """Threads for torch's intra-op pool: the cores that other processes leave idle,
    i.e. the cores less the load average rounded to a whole number, and at least one.

    ``load`` is the load average seen before this process starts working (its own
    threads are not in it yet); ``None`` reads the OS's. Unknown load means all cores.
    """
    n = available_cores() if cores is None else max(1, cores)
    seen = load_average() if load is None else load
    if seen is None:
        return n
    return max(1, min(n, n - round(seen)))


def use_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads to ``n`` (``suggest_threads()`` if None); returns it.

    This is process-wide torch state: call it from an entry point (a CLI command, a
    server start), never from library code.
    """
    threads = suggest_threads() if n is None else n
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads
