"""Peak dense bf16 throughput and memory bandwidth of a few accelerators, and a measured
entry for this machine.

The figures are the vendors' public spec-sheet numbers for dense (not 2:4 sparse) bf16
tensor math and peak HBM/GDDR bandwidth; a projection scales them by MFU and MBU, the
fractions a real kernel reaches. "this machine" is measured instead: a large bf16 (or
fp32) matmul for the compute peak and a streaming read for the bandwidth, in the same
process, so it reflects the neighbours' load at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16, FLOP/s
    bandwidth: float  # bytes/s
    source: str


REGISTRY: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "A100",
            312e12,
            2.039e12,
            "NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e",
        ),
        Accelerator(
            "H100",
            989.4e12,
            3.35e12,
            "NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1,979 sparse), 3.35 TB/s HBM3",
        ),
        Accelerator(
            "H200",
            989.4e12,
            4.8e12,
            "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e",
        ),
        Accelerator(
            "B200",
            2.25e15,
            8.0e12,
            "NVIDIA HGX B200: 2.25 PFLOPS bf16 dense (4.5 sparse), 8 TB/s HBM3e",
        ),
        Accelerator(
            "MI300X",
            1307.4e12,
            5.3e12,
            "AMD Instinct MI300X datasheet: 1,307.4 TFLOPS bf16 dense, 5.3 TB/s HBM3",
        ),
        Accelerator(
            "RTX5090",
            209.5e12,
            1.792e12,
            "NVIDIA RTX Blackwell whitepaper, GeForce RTX 5090: 209.5 TFLOPS bf16 "
            "tensor dense with fp32 accumulate, 1,792 GB/s GDDR7",
        ),
    )
}


def resolve(names: str) -> list[Accelerator]:
    """Accelerators from a comma list of registry names (any case), or ``all``."""
    if names.strip().lower() == "all":
        return list(REGISTRY.values())
    by_lower = {k.lower(): v for k, v in REGISTRY.items()}
    out = []
    for n in (p.strip() for p in names.split(",") if p.strip()):
        if n.lower() not in by_lower:
            raise ValueError(f"unknown accelerator {n!r}; known: {', '.join(REGISTRY)}, all")
        out.append(by_lower[n.lower()])
    return out


