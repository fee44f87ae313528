"""Decode attention: every decode row of a layer over the pool rows of its ``RunPlan``.

One call of the fused kernel (``csrc/decode_attn.cpp``, in the native extension) serves all
decode rows of a layer: for each row and KV head it walks the kept rows once, in tiles,
scoring them against all of that head's query heads (GQA), with an online softmax and
fp32 accumulation. A run costs a few pointers, not a torch call, so a DA view of a few
runs reads at the speed of a full one. Where the kernel cannot be had (no extension, a
non-CPU pool), the same result comes from torch ops (``decode_torch.py``), one row at a
time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from declattn.engine.decode_torch import torch_decode
from declattn.engine.native import decode_op
from declattn.engine.runs import RunPlan

Kernel = Literal["auto", "native", "torch"]
# A row's kept rows are split across threads only in pieces of at least this many rows:
# below it the merge of the partial softmaxes costs more than the split saves.
MIN_SPLIT_ROWS = 256
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class RunBatch:
    """The plans of a layer's decode rows, concatenated for one kernel call: ``runs``
    ``[N, 2]`` holds every row's ranges in order, row ``b`` owning
    ``runs[offsets[b]:offsets[b + 1]]``. Built once per step and kind of layer."""

    plans: tuple[RunPlan, ...]
    runs: Tensor
    offsets: Tensor

    @classmethod
    def of(cls, plans: Sequence[RunPlan]) -> RunBatch:
        rows = [p.rows for p in plans]
        runs = np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        return cls(tuple(plans), torch.from_numpy(runs), torch.from_numpy(offsets))


def kernel_in_use(pool: Tensor) -> str:
    """``native`` where the fused kernel serves decode rows over ``pool``, else ``torch``."""
    native = pool.device.type == "cpu" and pool.dtype in _NATIVE_DTYPES and decode_op() is not None
    return "native" if native else "torch"


def resolve_kernel(kernel: Kernel, pool: Tensor) -> Kernel:
    """``kernel`` with ``auto`` replaced by the path that serves ``pool`` here."""
    return kernel_in_use(pool) if kernel == "auto" else kernel  # type: ignore[return-value]


def decode_batch(
    kp: Tensor,
    vp: Tensor,
    q: Tensor,
    batch: RunBatch,
    scale: float,
    kernel: Kernel = "auto",
    placement_invariant: bool = False,
) -> Tensor:
    """Attention of query rows ``q [B, H, D]`` over the pools ``kp, vp [Hkv, rows, D]``,
    row ``b`` reading the rows of ``batch.plans[b]`` -> ``[B, H, D]`` in ``q``'s dtype
    (accumulated in fp32 on both paths).

    ``kernel`` forces a path (tests and benchmarks compare them); ``native`` raises when
    the kernel is unavailable. ``placement_invariant``: a row's result must not depend
    on where its blocks sit in the pool. The fused kernel always sums rows in the plan's
    logical order, in tiles counted from its first row; the torch path then pays one
    gather of the kept rows (``torch_decode``'s ``in_order``)."""
    if resolve_kernel(kernel, kp) == "torch":
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for b, plan in enumerate(batch.plans):
            out[b] = torch_decode(kp, vp, q[b], plan, scale, placement_invariant)
        return out
    op = decode_op()
    if op is None:
        raise RuntimeError("the fused decode kernel is unavailable (see the warning above)")
    return op(q.contiguous(), kp, vp, batch.runs, batch.offsets, scale, MIN_SPLIT_ROWS)


def decode_runs(
    kp: Tensor,
    vp: Tensor,
    q: Tensor,
    rows: Sequence[tuple[int, int]],
    scale: float,
    block_size: int = 16,
    kernel: Kernel = "auto",
) -> Tensor:
    """One query row ``q [H, D]`` over explicit pool row ranges -> ``[H, D]`` in ``q``'s
    dtype (for tests and benchmarks)."""
    plan = RunPlan.from_rows(rows, block_size, device=str(kp.device))
    return decode_batch(kp, vp, q[None], RunBatch.of([plan]), scale, kernel)[0]
