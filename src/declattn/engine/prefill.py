"""Prefill attention: the prompt's rows, causally, over every stored position.

Every mode attends fully during prefill, so this reads the whole prompt; DA saves on
decode rows only. A chunk over earlier context scores that context without a mask and
the chunk itself causally, merged by log-sum-exp (no [n, S] mask is built); a
sliding-window layer, or a torch without the flash op, uses explicit masks in groups
of rows.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import ParamSpec

import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.flash import flash_with_lse

# Prefill splits query rows so one boolean mask stays under this many elements.
_PREFILL_MASK_ELEMS = 1 << 25

_P = ParamSpec("_P")

TORCH_BF16_FAILURE = "pack_vnni2"
"""What torch's error says when its bf16 attention kernel cannot run here (see below)."""

FP32_FALLBACK_WARNING = (
    "torch's bf16 attention kernel failed (pack_vnni2: it needs the AVX-512 that "
    "ATEN_CPU_CAPABILITY is keeping ATen from), so prefill attention runs in fp32, slower; "
    "unset ATEN_CPU_CAPABILITY to use the bf16 kernel"
)


def _fp32_where_bf16_fails(
    attend: Callable[_P, Tensor],
) -> Callable[_P, Tensor]:
    """``attend`` (q, k, v first), redone in fp32 where torch's bf16 kernel fails.

    Why: on a Xeon with AMX and AVX-512, with ``ATEN_CPU_CAPABILITY=avx2`` set, torch
    2.13's fused bf16 attention raised its own error ("pack_vnni2 is only supported when
    avx512 is supported") on every prefill longer than a few rows, so a request failed in
    its first step. The same attention in fp32 runs through another kernel there, so the
    request now runs, with one warning naming the cause and the fix. Any other error is
    raised as it is.
    """

    @functools.wraps(attend)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> Tensor:
        try:
            return attend(*args, **kwargs)
        except RuntimeError as err:
            q = args[0] if args else kwargs.get("q")
            bf16 = isinstance(q, Tensor) and q.dtype == torch.bfloat16
            if not bf16 or TORCH_BF16_FAILURE not in str(err):
                raise
        warnings.warn(FP32_FALLBACK_WARNING, RuntimeWarning, stacklevel=2)
        wide = [a.float() if i < 3 and isinstance(a, Tensor) else a for i, a in enumerate(args)]
        named = {n: a.float() if n in ("q", "k", "v") and isinstance(a, Tensor) else a
                 for n, a in kwargs.items()}
        return attend(*wide, **named).to(torch.bfloat16)  # type: ignore[arg-type]

    return run


def _context_then_chunk(q4: Tensor, k4: Tensor, v4: Tensor, n_ctx: int, scale: float) -> Tensor:
    """Causal attention of the last ``n`` positions as (earlier context, no mask) +
    (the chunk itself, causal), merged exactly by log-sum-exp.

    ``q4 [1, H, n, D]``, ``k4, v4 [1, Hkv, n_ctx + n, D]``. The context part folds each
    KV head's query group into its rows (``[1, Hkv, G * n, D]``), so grouped heads read
    each key once and no key is repeated in memory; the chunk part is small (``n x n``)
    and repeats its own keys per query head.
    """
    flash = flash_with_lse()
    assert flash is not None
    _, n_heads, n, dim = q4.shape
    n_kv = k4.shape[1]
    group = n_heads // n_kv
    qc = q4.reshape(1, n_kv, group * n, dim)
    o1, l1 = flash(qc, k4[:, :, :n_ctx], v4[:, :, :n_ctx], scale=scale)
    kc, vc = k4[:, :, n_ctx:], v4[:, :, n_ctx:]
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    o2, l2 = flash(q4, kc, vc, is_causal=True, scale=scale)
    # o = w * o1 + (1 - w) * o2 with w = e^l1 / (e^l1 + e^l2) = sigmoid(l1 - l2).
    w = torch.sigmoid(l1.reshape(1, n_heads, n) - l2)[..., None]
    o1 = o1.reshape(1, n_heads, n, dim).float()
    return o2.float().lerp_(o1, w).to(q4.dtype)


def _mask_rows(n_keys: int) -> int:
    return max(1, _PREFILL_MASK_ELEMS // max(1, n_keys))


@_fp32_where_bf16_fails
def prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, start: int, scale: float, window: int | None
) -> Tensor:
    """Causal (optionally windowed) attention of ``q [n, H, D]`` at positions
    ``start .. start + n - 1`` over keys ``k, v [Hkv, S, D]`` holding positions
    ``[start + n - S, start + n)`` (the pool layout: a slice of it is zero-copy).

    Runs fused SDPA in the dtype of ``q`` (keys are cast only if the pool's dtype
    differs), grouped heads without repeating keys. Returns ``[n, H, D]``.
    """
    n = q.shape[0]
    k_lo = start + n - k.shape[1]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q4 = q.permute(1, 0, 2).unsqueeze(0)
    k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    if window is None and k_lo == start:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].permute(1, 0, 2)
    if window is None and k_lo == 0 and q.device.type == "cpu" and flash_with_lse() is not None:
        return _context_then_chunk(q4, k4, v4, start, scale)[0].permute(1, 0, 2)
    return masked_prefill_attention(q, k, v, start, scale, window)


@_fp32_where_bf16_fails
def masked_prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, start: int, scale: float, window: int | None
) -> Tensor:
    """``prefill_attention`` through explicit boolean masks, in groups of query rows.

    The path of sliding-window layers, and of chunks over earlier context where torch
    lacks the flash op (or off CPU); the tests also hold the context-then-chunk merge
    against it. Same arguments and result as ``prefill_attention``.
    """
    n = q.shape[0]
    end = start + n
    k_lo = end - k.shape[1]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q4 = q.permute(1, 0, 2).unsqueeze(0)
    k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    out = torch.empty_like(q)
    # Rows go in groups so that one mask stays small; on a sliding-window layer a group
    # also reads only the keys its rows can see.
    rows = _mask_rows(end - k_lo) if window is None else max(1, min(n, window))
    for qa in range(start, end, rows):
        qb = min(end, qa + rows)
        lo = k_lo if window is None else max(k_lo, qa - window + 1)
        qpos = torch.arange(qa, qb, device=q.device)[:, None]
        kpos = torch.arange(lo, qb, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(
            q4[:, :, qa - start : qb - start],
            k4[:, :, lo - k_lo : qb - k_lo],
            v4[:, :, lo - k_lo : qb - k_lo],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qa - start : qb - start] = o[0].permute(1, 0, 2)
    return out


@_fp32_where_bf16_fails
def viewed_prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    scale: float,
    views: Sequence[Sequence[int] | None],
    block_size: int,
) -> Tensor:
    """Causal attention where row ``i`` (position ``start + i``) reads only the positions
    of the logical blocks ``views[i]`` (``None``: everything): decode steps recomputed as
    one prefill, each row reading what its step read. A preempted DA request resumes
    this way, so the K/V it recomputes is the K/V its own views produced.

    ``k, v [Hkv, start + n, D]`` hold positions ``[0, start + n)``; returns ``[n, H, D]``.
    """
    n = q.shape[0]
    end = start + n
    if k.shape[1] != end:
        raise ValueError("viewed prefill needs every stored position's keys")
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q4 = q.permute(1, 0, 2).unsqueeze(0)
    k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    n_blocks = -(-end // block_size)
    kpos = torch.arange(end, device=q.device)
    out = torch.empty_like(q)
    rows = _mask_rows(end)
    for qa in range(0, n, rows):
        qb = min(n, qa + rows)
        mask = kpos[None, :] <= (start + torch.arange(qa, qb, device=q.device))[:, None]
        for i in range(qa, qb):
            view = views[i]
            if view is not None:
                kept = torch.zeros(n_blocks, dtype=torch.bool, device=q.device)
                kept[torch.as_tensor(list(view), dtype=torch.long, device=q.device)] = True
                mask[i - qa] &= kept.repeat_interleave(block_size)[:end]
        o = F.scaled_dot_product_attention(
            q4[:, :, qa:qb], k4, v4, attn_mask=mask[None, None], scale=scale, enable_gqa=True
        )
        out[qa:qb] = o[0].permute(1, 0, 2)
    return out

