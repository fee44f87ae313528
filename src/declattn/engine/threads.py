"""How many threads torch should use on a CPU that other processes share.

Every torch op that runs in parallel ends at a barrier, so it finishes only when its
slowest thread does. When the machine has fewer idle cores than torch has threads, a
thread waits for a time slice and small ops (a norm, a rotary, a residual add) take
milliseconds instead of microseconds: on a 2-core machine with 7 runnable processes, a
SmolLM2 prefill chunk ran 10 times slower with 2 threads than with 1. One thread per
idle core avoids that; an idle machine still gets every core.

Idle cores are measured, not guessed from the load average: ``/proc/stat``'s idle time
over a short window says what the machine does now, while the one-minute load average
still holds whatever ran in the last minutes (an install just finished, a build) and
would leave a quiet machine's cores unused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

IDLE_WINDOW_SECONDS = 0.3
"""How long ``idle_cores`` watches the machine: long enough for the kernel's tick
counters to move on every core, short enough not to be felt at a command's start."""


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The one-minute load average, or ``None`` where the OS has none (benchmark headers
    record it; the thread choice does not use it)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU time counters at one moment (``/proc/stat``, in ticks)."""

    idle: int  # idle and waiting for I/O: time no process wanted the core
    total: int
    cpus: int  # the per-core lines: the machine's cores, whatever this process may use

    @classmethod
    def parse(cls, text: str) -> CpuTimes:
        """From ``/proc/stat``'s text: its summed ``cpu`` line and one ``cpuN`` per core."""
        lines = text.splitlines()
        head = next((ln for ln in lines if ln.split()[:1] == ["cpu"]), None)
        if head is None:
            raise ValueError("no 'cpu' line in /proc/stat")
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [int(v) for v in head.split()[1:9]]
        if len(ticks) < 5:
            raise ValueError(f"a short 'cpu' line in /proc/stat: {head!r}")
        cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
        return cls(idle=ticks[3] + ticks[4], total=sum(ticks), cpus=max(1, cpus))


def read_proc_stat() -> str | None:
    """``/proc/stat``'s text, or ``None`` where the OS has none."""
    try:
        return Path("/proc/stat").read_text()
    except OSError:
        return None


def idle_cores(
    read: Callable[[], str | None] = read_proc_stat,
    sleep: Callable[[float], None] = time.sleep,
    window: float = IDLE_WINDOW_SECONDS,
) -> float | None:
    """Cores the machine left idle over ``window`` seconds (e.g. 1.6 of 2), from two
    reads of ``/proc/stat``; ``None`` where it cannot be read or did not move."""
    first = read()
    sleep(window)
    second = read()
    if first is None or second is None:
        return None
    try:
        a, b = CpuTimes.parse(first), CpuTimes.parse(second)
    except ValueError:
        return None
    ticks = b.total - a.total
    if ticks <= 0:
        return None
    return b.cpus * max(0, b.idle - a.idle) / ticks


def suggest_threads(cores: int, idle: float | None) -> int:
    """Threads for torch's intra-op pool: the idle cores rounded to the nearest whole one,
    at least one and at most ``cores`` (this process's); all ``cores`` when ``idle`` is
    unknown."""
    if idle is None:
        return max(1, cores)
    return max(1, min(cores, int(idle + 0.5)))


@dataclass(frozen=True)
class ThreadChoice:
    """The threads torch was given, and why (one line for a command's output)."""

    threads: int
    cores: int
    reason: str

    def line(self) -> str:
        return (f"torch threads: {self.threads} of {self.cores} cores ({self.reason}; "
                "--threads N chooses)")


def choose_threads(
    n: int | None = None, measure: Callable[[], float | None] = idle_cores
) -> ThreadChoice:
    """``n`` threads if given, else one per idle core (``measure``: idle cores now)."""
    cores = available_cores()
    if n is not None:
        return ThreadChoice(n, cores, "as asked")
    idle = measure()
    threads = suggest_threads(cores, idle)
    if idle is None:
        return ThreadChoice(threads, cores, "every core: idle time could not be measured")
    why = f"{idle:.1f} cores idle over {IDLE_WINDOW_SECONDS:.1f} s"
    return ThreadChoice(threads, cores, why)


def use_threads(n: int | None = None) -> ThreadChoice:
    """Set torch's intra-op threads to ``n`` (one per idle core if None); returns the
    choice and its reason.

    This is process-wide torch state: call it from an entry point (a CLI command, a
    server start), never from library code.
    """
    if n is not None and n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    choice = choose_threads(n)
    torch.set_num_threads(choice.threads)
    return choice
