"""What a benchmark ran on, and how fast this machine moves memory right now.

A decode step on a CPU is a memory-bound read, so every timing is reported beside the
bandwidth measured in the same process and the same minutes: on a shared machine the
bandwidth moves with the neighbours' load, and a ratio of two figures taken at
different times would measure the neighbours.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from declattn.engine.threads import available_cores, load_average
from declattn.eval.accelerators import Accelerator


def cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo``, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU, cores, threads, library versions, date and load: the header of a result."""
    return {
        "cpu": cpu_model(),
        "cores": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": load_average(),
    }


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing, in seconds."""

    best: float
    median: float
    runs: int

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        if not samples:
            raise ValueError("no samples")
        return cls(min(samples), statistics.median(samples), len(samples))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def time_call(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth from one large buffer, in bytes per second.

    ``copy`` counts the bytes read plus the bytes written (2 x buffer per copy; the
    cache lines a store first reads are not counted, so the hardware moved more).
    ``read`` is a reduction that only reads. ``read`` is the roofline for decode,
    which reads KV and weights and writes next to nothing.
    """

    buffer_bytes: int
    copy_best: float
    copy_median: float
    read_best: float
    read_median: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class BandwidthProbe:
    """A buffer to copy and sum, so that bandwidth samples can interleave with the arms
    of a benchmark (the same minutes, the same neighbours)."""

    def __init__(self, nbytes: int = 256 * 2**20) -> None:
        n = max(1, nbytes // 4)
        self.src = torch.empty(n, dtype=torch.float32).uniform_()
        self.dst = torch.empty_like(self.src)
        self.copies: list[float] = []
        self.reads: list[float] = []

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()

    def sample(self) -> None:
        self.copies.append(time_call(lambda: self.dst.copy_(self.src)))
        self.reads.append(time_call(lambda: self.src.sum()))

    def flush(self) -> None:
        """Evict the caches (a step in a real model streams weights through them)."""
        self.dst.copy_(self.src)

    def result(self) -> Bandwidth:
        c, r = Timing.of(self.copies), Timing.of(self.reads)
        nb = self.nbytes
        return Bandwidth(nb, 2 * nb / c.best, 2 * nb / c.median, nb / r.best, nb / r.median)


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> Bandwidth:
    probe = BandwidthProbe(nbytes)
    probe.sample()  # first touch of the destination pages is not bandwidth
    probe.copies.clear()
    probe.reads.clear()
    for _ in range(repeats):
        probe.sample()
    return probe.result()


def measure_this_machine(
    dtype: str = "bf16", size: int = 1024, seconds: float = 1.0
) -> Accelerator:
    """This machine's achievable matmul throughput and read bandwidth, measured now with
    the current torch thread count (the roofline's ``this`` accelerator)."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    a = torch.randn(size, size).to(dt)
    b = torch.randn(size, size).to(dt)
    torch.mm(a, b)  # warm up
    runs, t0 = 0, time.perf_counter()
    best = float("inf")
    while time.perf_counter() - t0 < seconds or runs < 3:
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
        runs += 1
    flops = 2 * size**3 / best
    bw = measure_bandwidth().read_best
    return Accelerator(
        "this machine",
        flops,
        bw,
        f"measured: {dtype} {size}x{size} matmul best of {runs}, "
        f"{torch.get_num_threads()} threads; sum over a 256 MiB buffer",
    )
