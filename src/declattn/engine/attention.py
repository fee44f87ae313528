"""Paged attention: the ``AttentionFn`` that reads only the KV blocks of a sequence's view.

This is where Declarative Attention saves work. A decode row on a global layer never
gathers the whole context: the kept blocks are grouped into runs of physically
consecutive blocks, each run is a zero-copy slice of the pool (isolated blocks are
gathered together, block by block), scores of all runs share one softmax, and each
run's values are weighted from its own slice. The bytes touched are therefore the kept
blocks' bytes, and ``ReadCounter`` records what was actually read so the claim can be
tested rather than assumed.

Prefill rows (and chunked prefill) attend causally over every stored position: every
mode reads the whole prompt while it is being filled in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from declattn.engine.kv import KVCache, inverse_table

# Runs up to this many rows are scored with one batched matmul over heads (fewer calls);
# longer runs go head by head, which reads strided pools at full speed on CPU.
_BATCHED_RUN_ROWS = 512
# Runs up to this many rows are gathered together rather than sliced one by one...
_GATHER_RUN_ROWS = 128
# ...when there are at least this many of them (a few runs cost less as slices).
_GATHER_MIN_RUNS = 8
# On CPU, runs up to this many rows go through the fused flash kernel, one call per run
# whatever the head count; longer runs read faster through BLAS, head by head.
_FLASH_RUN_ROWS = 1024
# Prefill splits query rows so one boolean mask stays under this many elements.
_PREFILL_MASK_ELEMS = 1 << 25


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a batch step.

    Its ``n_new`` tokens sit at positions ``start .. start + n_new - 1`` and are rows of
    the step's q/k/v in batch order. ``view`` lists the logical blocks
    (``position // block_size``) that global layers may read on a decode row
    (``n_new == 1``); ``None`` reads everything. Prefill rows ignore the view: every
    mode attends fully during prefill.

    ``select``, when given, replaces ``view`` on each global layer of a decode row: it is
    called with the layer index and the row's query ``[H, D]`` (rotated, unscaled) once
    that layer's new key is stored, and returns the blocks that layer reads. It is the
    hook for query-aware selection (Quest-style baselines), which cannot know its blocks
    before the query exists.
    """

    seq_id: int
    start: int
    n_new: int
    view: Sequence[int] | None = None
    select: Callable[[int, Tensor], Sequence[int]] | None = None

    @property
    def length(self) -> int:
        """Sequence length once this step's tokens are stored."""
        return self.start + self.n_new

    @property
    def is_decode(self) -> bool:
        return self.n_new == 1


@dataclass(frozen=True)
class ReadRecord:
    """What one decode row read in one layer call."""

    step: int
    layer: int
    seq_id: int
    blocks: tuple[int, ...]
    n_bytes: int
    sliding: bool


@dataclass
class ReadCounter:
    """Blocks and bytes that decode attention actually sliced out of the pools.

    Global-layer reads (the ones a view restricts) and sliding-window reads are kept
    apart so a test can hold the global reads against the view exactly. ``n_bytes``
    counts K and V of the positions sliced; the unfilled tail of the newest block is
    not read and not counted.
    """

    records: list[ReadRecord] = field(default_factory=list)
    n_steps: int = 0
    _index: dict[tuple[int, int, int, bool], list[ReadRecord]] = field(
        default_factory=dict, repr=False
    )
    # (step, seq, sliding): the engine asks per sequence and step, and a scan of every
    # record for each sequence made a batched step quadratic in the batch
    _rows: dict[tuple[int, int, bool], list[ReadRecord]] = field(
        default_factory=dict, repr=False
    )

    def begin_step(self) -> int:
        """Open a new step and return its index (one per ``PagedAttention``)."""
        self.n_steps += 1
        return self.n_steps - 1

    def record(self, rec: ReadRecord) -> None:
        self.records.append(rec)
        self._index.setdefault((rec.step, rec.seq_id, rec.layer, rec.sliding), []).append(rec)
        self._rows.setdefault((rec.step, rec.seq_id, rec.sliding), []).append(rec)

    def reset(self) -> None:
        self.records.clear()
        self._index.clear()
        self._rows.clear()
        self.n_steps = 0

    def _select(
        self,
        *,
        sliding: bool,
        step: int | None = None,
        seq_id: int | None = None,
        layer: int | None = None,
    ) -> list[ReadRecord]:
        pool = self.records
        if step is not None and seq_id is not None:
            pool = self._rows.get((step, seq_id, sliding), [])
        return [
            r
            for r in pool
            if r.sliding == sliding
            and (step is None or r.step == step)
            and (seq_id is None or r.seq_id == seq_id)
            and (layer is None or r.layer == layer)
        ]

    def blocks_read(
        self, step: int, seq_id: int, layer: int, *, sliding: bool = False
    ) -> tuple[int, ...] | None:
        """Logical blocks one decode row read in one layer; ``None`` if it read nothing."""
        recs = self._index.get((step, seq_id, layer, sliding))
        if not recs:
            return None
        return tuple(sorted({b for r in recs for b in r.blocks}))

    def per_step(self, seq_id: int, *, sliding: bool = False) -> dict[int, dict[int, tuple]]:
        """``{step: {layer: blocks}}`` for one sequence."""
        out: dict[int, dict[int, tuple]] = {}
        for r in self._select(sliding=sliding, seq_id=seq_id):
            out.setdefault(r.step, {})[r.layer] = r.blocks
        return out

    def total_bytes(
        self, *, sliding: bool = False, seq_id: int | None = None, step: int | None = None
    ) -> int:
        return sum(r.n_bytes for r in self._select(sliding=sliding, seq_id=seq_id, step=step))

    def total_blocks(
        self, *, sliding: bool = False, seq_id: int | None = None, step: int | None = None
    ) -> int:
        """Block reads summed over layers, rows and steps."""
        recs = self._select(sliding=sliding, seq_id=seq_id, step=step)
        return sum(len(r.blocks) for r in recs)

    def bytes_per_sequence(self, *, sliding: bool = False) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self._select(sliding=sliding):
            out[r.seq_id] = out.get(r.seq_id, 0) + r.n_bytes
        return out


def _expand(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], stops[i])``, vectorised."""
    lengths = stops - starts
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(int(lengths.sum()))


@dataclass(frozen=True)
class RunPlan:
    """The pool rows one decode row reads, and the logical blocks they cover.

    Long runs of consecutive rows, and partial blocks, are read as zero-copy slices.
    Short runs of whole blocks (left isolated by interleaved growth) are gathered
    together, block by block, with one ``index_select``: it reads the same bytes, and a
    matmul per tiny run would cost far more in call overhead than the copy does.
    """

    block_size: int
    slices: tuple[tuple[int, int], ...]
    gather: Tensor | None
    blocks: tuple[int, ...]
    n_rows: int

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[tuple[int, int]],
        block_size: int,
        table: Sequence[int] | None = None,
        device: str = "cpu",
        inverse: np.ndarray | None = None,
    ) -> RunPlan:
        """Plan the reads of pool ``rows``; ``table`` (physical id of each logical
        block), or its ``inverse`` (logical index of each physical block, -1 for none),
        lets the plan name the logical blocks its reads cover."""
        bs = block_size
        r = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        whole = (r[:, 0] % bs == 0) & (r[:, 1] % bs == 0)
        short = whole & (r[:, 1] - r[:, 0] <= _GATHER_RUN_ROWS)
        if short.sum() < _GATHER_MIN_RUNS:
            short[:] = False
        slices = tuple((int(x), int(y)) for x, y in r[~short])
        gathered = _expand(r[short, 0] // bs, r[short, 1] // bs)
        gather = torch.from_numpy(gathered).to(device) if gathered.size else None
        blocks: tuple[int, ...] = ()
        if inverse is None and table is not None:
            inverse = inverse_table(np.asarray(table, dtype=np.int64))
        if inverse is not None:
            # Derived from what is read: the sliced rows' blocks plus the gathered ones.
            sl = r[~short]
            read = np.concatenate([_expand(sl[:, 0] // bs, (sl[:, 1] - 1) // bs + 1), gathered])
            ids = inverse[read]
            if ids.size > 1 and not bool((ids[1:] > ids[:-1]).all()):
                ids = np.unique(ids)
            blocks = tuple(ids.tolist())
        return cls(bs, slices, gather, blocks, int((r[:, 1] - r[:, 0]).sum()))


def _plan_runs(
    table: Sequence[int],
    keep: Sequence[int],
    lo: int,
    hi: int,
    bs: int,
    device: str,
    inverse: np.ndarray | None = None,
) -> RunPlan:
    """Group kept logical blocks into maximal runs of consecutive physical rows.

    Only positions in ``[lo, hi)`` are valid; a partial block ends (or starts) its run
    so that a run is one plain slice. Attention is order-free over keys (positions are
    already in the rotated keys), so runs follow physical order, not logical order.
    Vectorised: a 64K-token view has thousands of blocks and is planned every step.
    """
    tab = np.asarray(table, dtype=np.int64)
    lb = np.asarray(keep, dtype=np.int64)
    a = np.maximum(0, lo - lb * bs)
    b = np.minimum(bs, hi - lb * bs)
    valid = a < b
    phys, a, b = tab[lb[valid]], a[valid], b[valid]
    if phys.size == 0:
        return RunPlan(bs, (), None, (), 0)
    if phys.size > 1 and not bool((phys[1:] > phys[:-1]).all()):
        order = np.argsort(phys, kind="stable")
        phys, a, b = phys[order], a[order], b[order]
    # A block continues the previous run only if it is the next physical block, the
    # previous one was read to its end, and this one is read from its start.
    cont = np.zeros(phys.size, dtype=bool)
    cont[1:] = (phys[1:] == phys[:-1] + 1) & (b[:-1] == bs) & (a[1:] == 0)
    starts = np.flatnonzero(~cont)
    ends = np.append(starts[1:], phys.size) - 1
    rows = np.stack([phys[starts] * bs + a[starts], phys[ends] * bs + b[ends]], axis=1)
    return RunPlan.from_rows(rows, bs, table, device, inverse)


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
    """The blocks ``plan.gather`` of ``pool``, contiguous ``[Hkv, n * block_size, D]``.

    Head by head on a ``[blocks, block_size * D]`` view: a row gather of contiguous
    rows is a plain memcpy per block, where gathering along the middle dimension of
    the 3-D pool takes a slow generic path."""
    n_kv, rows, dim = pool.shape
    width = plan.block_size * dim
    n = plan.gather.numel()
    out = torch.empty(n_kv, n, width, dtype=pool.dtype, device=pool.device)
    for h in range(n_kv):
        torch.index_select(pool[h].view(rows // plan.block_size, width), 0, plan.gather, out=out[h])
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


def decode_attention(kp: Tensor, vp: Tensor, q: Tensor, plan: RunPlan, scale: float) -> Tensor:
    """Attention of one query row ``q [H, D]`` over the rows of ``plan`` -> fp32 ``[H, D]``.

    Every run is read in place (a zero-copy slice of the pool), so the bytes touched
    are the kept blocks' bytes. On CPU a short run is one call of the fused flash
    kernel with each KV head's query group folded into its rows (per-call overhead is
    what a short run costs); long runs go through BLAS head by head. Partials are
    merged exactly by their log-sum-exp.
    """
    n_heads, dim = q.shape
    n_kv = kp.shape[0]
    group = n_heads // n_kv
    # Folding the scale into q costs one rounding of a [H, D] vector instead of a pass
    # over the [Hkv, G, L] scores.
    qg = (q.float() * scale).to(kp.dtype).reshape(n_kv, group, dim)
    parts = [(kp[:, r0:r1], vp[:, r0:r1]) for r0, r1 in plan.slices]
    if plan.gather is not None:
        parts.append((_gather_blocks(kp, plan), _gather_blocks(vp, plan)))
    flash = _flash_with_lse() if kp.device.type == "cpu" else None
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


def decode_runs(
    kp: Tensor,
    vp: Tensor,
    q: Tensor,
    rows: Sequence[tuple[int, int]],
    scale: float,
    block_size: int = 16,
) -> Tensor:
    """``decode_attention`` over explicit pool row ranges (for tests and benchmarks)."""
    plan = RunPlan.from_rows(rows, block_size, device=str(kp.device))
    return decode_attention(kp, vp, q, plan, scale)


PREFILL_STRATEGIES = ("split", "mask")
"""How a chunk with earlier context attends (global layers): ``split`` scores the earlier
context without a mask and the chunk itself causally, then merges the two by their
log-sum-exp; ``mask`` makes one call with an explicit causal mask. A chunk without
earlier context is always one causal call, and sliding-window layers always use a mask."""

DEFAULT_PREFILL_STRATEGY = "split"


@functools.cache
def _flash_with_lse() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The CPU flash-attention op that also returns the log-sum-exp, if torch has it.

    Public SDPA does not return the log-sum-exp that merging partial attentions needs;
    this op (what SDPA itself calls on CPU) does. Without it, decode reads every run
    through BLAS and prefill uses an explicit mask: slower, same results."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


def _context_then_chunk(q4: Tensor, k4: Tensor, v4: Tensor, n_ctx: int, scale: float) -> Tensor:
    """Causal attention of the last ``n`` positions as (earlier context, no mask) +
    (the chunk itself, causal), merged exactly by log-sum-exp.

    ``q4 [1, H, n, D]``, ``k4, v4 [1, Hkv, n_ctx + n, D]``. The context part folds each
    KV head's query group into its rows (``[1, Hkv, G * n, D]``), so grouped heads read
    each key once and no key is repeated in memory; the chunk part is small (``n x n``)
    and repeats its own keys per query head.
    """
    flash = _flash_with_lse()
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


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    scale: float,
    window: int | None,
    strategy: str = DEFAULT_PREFILL_STRATEGY,
) -> Tensor:
    """Causal (optionally windowed) attention of ``q [n, H, D]`` at positions
    ``start .. start + n - 1`` over keys ``k, v [Hkv, S, D]`` holding positions
    ``[start + n - S, start + n)`` (the pool layout: a slice of it is zero-copy).

    Runs fused SDPA in the dtype of ``q`` (keys are cast only if the pool's dtype
    differs), grouped heads without repeating keys. Returns ``[n, H, D]``.
    """
    if strategy not in PREFILL_STRATEGIES:
        raise ValueError(f"prefill strategy must be one of {PREFILL_STRATEGIES}")
    n = q.shape[0]
    end = start + n
    k_lo = end - k.shape[1]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q4 = q.permute(1, 0, 2).unsqueeze(0)
    k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    if window is None and k_lo == start:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].permute(1, 0, 2)
    use_split = (
        window is None
        and k_lo == 0
        and strategy == "split"
        and q.device.type == "cpu"
        and _flash_with_lse() is not None
    )
    if use_split:
        return _context_then_chunk(q4, k4, v4, start, scale)[0].permute(1, 0, 2)
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


@dataclass
class _SeqPlan:
    step: SeqStep
    row: int
    table: np.ndarray
    global_runs: RunPlan | None
    # Prefill rows: pool rows of positions [0, length), a (lo, hi) range when the
    # sequence's blocks are physically consecutive (a zero-copy slice), else an index.
    key_rows: tuple[int, int] | Tensor | None = None
    window_runs: dict[int, RunPlan] = field(default_factory=dict)

    def keys(self, pool: Tensor, lo: int, hi: int) -> Tensor:
        """Pool rows of positions ``[lo, hi)`` as ``[Hkv, hi - lo, D]``."""
        rows = self.key_rows
        assert rows is not None, "only prefill rows read keys this way"
        if isinstance(rows, tuple):
            return pool[:, rows[0] + lo : rows[0] + hi]
        return pool.index_select(1, rows[lo:hi])


def _consecutive(table: np.ndarray) -> bool:
    return table.size < 2 or bool((np.diff(table) == 1).all())


def _as_rows(slots: list[Tensor]) -> Tensor | slice:
    """The step's new pool rows; one consecutive range becomes a slice (a plain copy
    instead of an indexed write, which matters once per layer per decode step)."""
    if not slots:
        return torch.empty(0, dtype=torch.int64)
    rows = torch.cat(slots) if len(slots) > 1 else slots[0]
    lo, n = int(rows[0]), rows.numel()
    if int(rows[-1]) == lo + n - 1 and (n < 3 or bool((rows.diff() == 1).all())):
        return slice(lo, lo + n)
    return rows


class PagedAttention:
    """``AttentionFn`` over a ``KVCache`` for one batch step of several sequences.

    Construct one per step (after ``cache.allocate`` covers every ``start + n_new``);
    the model calls it once per layer. Each call stores the step's new k/v, then
    attends: prefill rows causally over everything, decode rows on global layers over
    the view's blocks only, decode rows on sliding layers over the last ``window``
    positions. Everything that depends only on the step (run plans, slot maps) is
    worked out here, once, and shared by every layer.
    """

    def __init__(
        self,
        cache: KVCache,
        steps: Sequence[SeqStep],
        counter: ReadCounter | None = None,
        *,
        prefill_strategy: str = DEFAULT_PREFILL_STRATEGY,
    ) -> None:
        if prefill_strategy not in PREFILL_STRATEGIES:
            raise ValueError(f"prefill strategy must be one of {PREFILL_STRATEGIES}")
        self.cache = cache
        self.counter = counter
        self.prefill_strategy = prefill_strategy
        self._device = str(cache.config.device)
        bs = cache.block_size
        seen: set[int] = set()
        plans: list[_SeqPlan] = []
        new_slots: list[Tensor] = []
        row = 0
        for st in steps:
            if st.seq_id in seen:
                raise ValueError(f"sequence {st.seq_id} appears twice in one step")
            seen.add(st.seq_id)
            if st.start < 0 or st.n_new < 1:
                raise ValueError(f"bad step for sequence {st.seq_id}: {st}")
            if cache.capacity(st.seq_id) < st.length:
                raise ValueError(
                    f"sequence {st.seq_id} has {cache.capacity(st.seq_id)} slots, needs "
                    f"{st.length}: call cache.allocate first"
                )
            n_blocks = -(-st.length // bs)
            table = cache.block_array(st.seq_id)[:n_blocks]
            plan = _SeqPlan(st, row, table, None)
            if st.is_decode:
                keep = range(n_blocks) if st.view is None else self._check_view(st, n_blocks)
                plan.global_runs = _plan_runs(
                    table, keep, 0, st.length, bs, self._device, cache.block_inverse(st.seq_id)
                )
                new_slots.append(cache.slots(st.seq_id, st.start, st.length))
            elif _consecutive(table):
                first = int(table[0]) * bs
                plan.key_rows = (first, first + st.length)
                new_slots.append(
                    torch.arange(first + st.start, first + st.length, device=self._device)
                )
            else:
                slots = cache.slots(st.seq_id, 0, st.length)
                plan.key_rows = slots
                new_slots.append(slots[st.start :])
            plans.append(plan)
            row += st.n_new
        self._plans = plans
        self._n_rows = row
        self._new_slots = _as_rows(new_slots)
        self.step = counter.begin_step() if counter is not None else -1

    @staticmethod
    def _check_view(st: SeqStep, n_blocks: int) -> np.ndarray:
        keep = np.unique(np.asarray(st.view if st.view is not None else (), dtype=np.int64))
        if keep.size and (keep[0] < 0 or keep[-1] >= n_blocks):
            raise ValueError(f"view of sequence {st.seq_id} names blocks outside [0, {n_blocks})")
        if not keep.size or keep[-1] != n_blocks - 1:
            raise ValueError(
                f"view of sequence {st.seq_id} misses block {n_blocks - 1}, "
                "which holds the newest token"
            )
        return keep

    def _selected_runs(self, plan: _SeqPlan, layer: int, q: Tensor) -> RunPlan:
        """The runs of the blocks ``plan.step.select`` picks for this layer and query."""
        st = plan.step
        assert st.select is not None
        chosen = SeqStep(st.seq_id, st.start, st.n_new, st.select(layer, q))
        keep = self._check_view(chosen, len(plan.table))
        return _plan_runs(plan.table, keep, 0, st.length, self.cache.block_size, self._device)

    def _window_runs(self, plan: _SeqPlan, window: int) -> RunPlan:
        runs = plan.window_runs.get(window)
        if runs is None:
            st = plan.step
            lo = max(0, st.length - window)
            bs = self.cache.block_size
            keep = range(lo // bs, -(-st.length // bs))
            inverse = self.cache.block_inverse(st.seq_id)
            runs = _plan_runs(plan.table, keep, lo, st.length, bs, self._device, inverse)
            plan.window_runs[window] = runs
        return runs

    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> Tensor:
        if q.shape[0] != self._n_rows or k.shape[0] != self._n_rows:
            raise ValueError(f"step has {self._n_rows} rows, got q {tuple(q.shape)}")
        if window is not None and window < 1:
            raise ValueError("window must be >= 1")
        self.cache.write(layer, self._new_slots, k, v)
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        if len(self._plans) == 1 and not self._plans[0].step.is_decode:
            return self._prefill(self._plans[0], kp, vp, q, scale, window)
        out = torch.empty_like(q)
        per_token = self.cache.config.bytes_per_token
        for plan in self._plans:
            st, r = plan.step, plan.row
            if not st.is_decode:
                out[r : r + st.n_new] = self._prefill(
                    plan, kp, vp, q[r : r + st.n_new], scale, window
                )
                continue
            if window is not None:
                runs = self._window_runs(plan, window)
            elif st.select is not None:
                runs = self._selected_runs(plan, layer, q[r])
            else:
                runs = plan.global_runs
            assert runs is not None
            out[r] = decode_attention(kp, vp, q[r], runs, scale).to(q.dtype)
            if self.counter is not None:
                self.counter.record(
                    ReadRecord(
                        step=self.step,
                        layer=layer,
                        seq_id=st.seq_id,
                        blocks=runs.blocks,
                        n_bytes=runs.n_rows * per_token,
                        sliding=window is not None,
                    )
                )
        return out

    def _prefill(
        self, plan: _SeqPlan, kp: Tensor, vp: Tensor, q: Tensor, scale: float, window: int | None
    ) -> Tensor:
        st = plan.step
        lo = 0 if window is None else max(0, st.start - window + 1)
        return prefill_attention(
            q,
            plan.keys(kp, lo, st.length),
            plan.keys(vp, lo, st.length),
            st.start,
            scale,
            window,
            self.prefill_strategy,
        )
