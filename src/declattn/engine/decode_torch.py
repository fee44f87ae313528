"""Decode attention in torch ops: the fallback where the fused kernel is unavailable.

Each run is a zero-copy slice of the pool (short isolated blocks come gathered in one
piece, see ``RunPlan.pieces``); scores of all runs share one softmax, and each run's
values are weighted from its own slice, so the bytes touched are the kept blocks' bytes
and nothing else. It is exact, and it is what the fused kernel replaced: a torch call
per run is a fixed cost that dominates a view of short runs, and torch's bf16 matmul
of a few query rows runs far below memory bandwidth on CPUs without bf16 arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from declattn.engine.flash import flash_with_lse
from declattn.engine.runs import RunPlan

# Runs up to this many rows are scored with one batched matmul over heads (fewer calls);
# longer runs go head by head, which reads strided pools at full speed on CPU.
_BATCHED_RUN_ROWS = 512
# On CPU, runs up to this many rows go through the fused flash kernel, one call per run
# whatever the head count; longer runs read faster through BLAS, head by head.
_FLASH_RUN_ROWS = 1024


def _scores_into(qg: Tensor, kr: Tensor, out: Tensor) -> None:
    """``qg [Hkv, G, D]`` · ``kr [Hkv, L, D]`` -> ``out [Hkv, G, L]`` (pool dtype).

    One batched matmul is fast for short or contiguous keys; a long strided slice of
    the pool goes head by head, which CPU BLAS reads at full speed where a strided
    batched matmul does not."""
    if kr.shape[1] <= _BATCHED_RUN_ROWS or kr.is_contiguous():
        out.copy_(torch.matmul(qg, kr.transpose(1, 2)))
        return
    for h in range(qg.shape[0]):
        torch.mm(qg[h], kr[h].T, out=out[h])


def _weighted_values(p: Tensor, vr: Tensor) -> Tensor:
    """``p [Hkv, G, L]`` · ``vr [Hkv, L, D]`` -> ``[Hkv, G, D]`` (pool dtype)."""
    if vr.shape[1] <= _BATCHED_RUN_ROWS or vr.is_contiguous():
        return torch.matmul(p.contiguous(), vr)
    o = torch.empty(p.shape[0], p.shape[1], vr.shape[2], dtype=vr.dtype, device=vr.device)
    for h in range(p.shape[0]):
        torch.mm(p[h], vr[h], out=o[h])
    return o


def _gather_blocks(pool: Tensor, plan: RunPlan) -> Tensor:
    """The blocks ``plan.pieces.gather`` of ``pool``, contiguous ``[Hkv, n * block_size, D]``.

    Head by head on a ``[blocks, block_size * D]`` view: a row gather of contiguous
    rows is a plain memcpy per block, where gathering along the middle dimension of
    the 3-D pool takes a slow generic path."""
    n_kv, rows, dim = pool.shape
    width = plan.block_size * dim
    gather = plan.pieces.gather
    assert gather is not None
    n = gather.numel()
    out = torch.empty(n_kv, n, width, dtype=pool.dtype, device=pool.device)
    for h in range(n_kv):
        torch.index_select(pool[h].view(rows // plan.block_size, width), 0, gather, out=out[h])
    return out.view(n_kv, n * plan.block_size, dim)


def _blas_runs(qg: Tensor, parts: list[tuple[Tensor, Tensor]], with_lse: bool):
    """Runs scored through BLAS: one score buffer in the pool dtype (no fp32 copy of K
    or V is made), one softmax over it (a log-sum-exp merge of per-run partials would
    give the same, in more passes), each run's values weighted from its own slice.

    Returns the fp32 output ``[Hkv, G, D]`` and, if asked, the scores' log-sum-exp
    ``[Hkv, G]`` for merging with other partials."""
    n_kv, group, _ = qg.shape
    n = sum(kr.shape[1] for kr, _ in parts)
    s = torch.empty(n_kv, group, n, dtype=qg.dtype, device=qg.device)
    off = 0
    for kr, _ in parts:
        _scores_into(qg, kr, s[:, :, off : off + kr.shape[1]])
        off += kr.shape[1]
    lse = None
    if with_lse:
        # Softmax and log-sum-exp from one exp pass (logsumexp, then softmax, would
        # take two, and exp over every kept position is not free on a CPU).
        s32 = s.float()
        m = s32.amax(dim=-1, keepdim=True)
        e = s32.sub_(m).exp_()
        total = e.sum(dim=-1, keepdim=True)
        lse = (m + total.log()).squeeze(-1)
        p = e.div_(total).to(qg.dtype)
    else:
        p = torch.softmax(s, dim=-1)
    out: Tensor | None = None
    off = 0
    for _, vr in parts:
        o = _weighted_values(p[:, :, off : off + vr.shape[1]], vr)
        out = o.float() if out is None else out.add_(o)
        off += vr.shape[1]
    assert out is not None
    return out, lse


def torch_decode(
    kp: Tensor, vp: Tensor, q: Tensor, plan: RunPlan, scale: float, in_order: bool = False
) -> Tensor:
    """Attention of one query row ``q [H, D]`` over the rows of ``plan`` -> fp32 ``[H, D]``.

    Every run is read in place (a zero-copy slice of the pool), so the bytes touched
    are the kept blocks' bytes. On CPU a short run is one call of the fused flash
    kernel with each KV head's query group folded into its rows (per-call overhead is
    what a short run costs); long runs go through BLAS head by head. Partials are
    merged exactly by their log-sum-exp.

    How the rows split into pieces depends on where the blocks sit, and so does the
    rounding. ``in_order`` gathers all of them into one piece in the plan's (logical)
    order instead: a copy of the kept K/V, for a result that depends only on the
    sequence (batch-invariant mode).
    """
    n_heads, dim = q.shape
    n_kv = kp.shape[0]
    group = n_heads // n_kv
    # Folding the scale into q costs one rounding of a [H, D] vector instead of a pass
    # over the [Hkv, G, L] scores.
    qg = (q.float() * scale).to(kp.dtype).reshape(n_kv, group, dim)
    if in_order:
        rows = plan.row_index
        parts = [(kp.index_select(1, rows), vp.index_select(1, rows))]
    else:
        parts = [(kp[:, r0:r1], vp[:, r0:r1]) for r0, r1 in plan.pieces.slices]
        if plan.pieces.gather is not None:
            parts.append((_gather_blocks(kp, plan), _gather_blocks(vp, plan)))
    flash = flash_with_lse() if kp.device.type == "cpu" else None
    if flash is None:
        return _blas_runs(qg, parts, False)[0].reshape(n_heads, dim)
    long = [pt for pt in parts if pt[0].shape[1] > _FLASH_RUN_ROWS]
    short = [pt for pt in parts if pt[0].shape[1] <= _FLASH_RUN_ROWS]
    if not short:
        return _blas_runs(qg, long, False)[0].reshape(n_heads, dim)
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    if long:
        o, lse = _blas_runs(qg, long, True)
        outs.append(o)
        lses.append(lse)
    qf = qg.unsqueeze(0)
    for kr, vr in short:
        o, lse = flash(qf, kr.unsqueeze(0), vr.unsqueeze(0), scale=1.0)
        outs.append(o.reshape(n_kv, group, dim))
        lses.append(lse.reshape(n_kv, group))
    if len(outs) == 1:
        return outs[0].float().reshape(n_heads, dim)
    w = torch.softmax(torch.stack(lses), dim=0)
    out = outs[0].float().mul_(w[0, ..., None])
    for o, wi in zip(outs[1:], w[1:], strict=True):
        out.add_(o.float().mul_(wi[..., None]))
    return out.reshape(n_heads, dim)
