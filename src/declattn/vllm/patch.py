"""The skipping: a wrapper around attention metadata builders' ``build``.

Both of vLLM's model runners turn a step's common metadata into each backend's metadata
through the builder's ``build`` (V1 in its runner, V2 in ``attn_utils.build_attn_metadata``
via ``AttentionGroup.build_metadata``). Before the stock builder runs, the wrapper asks
the engine's DA processor which rows are tracked decode rows (DA requests, and the
StreamingLLM baseline's, ``streaming.py``) and which logical blocks each may read, and
hands the builder a copy of the metadata whose block-table rows and sequence lengths
are compacted to those blocks (``compact.py``). The stock kernel then reads fewer
pages; it is not changed.

The runners name a row's request differently: V1 by the batch row itself, V2 by a
persistent request slot (``CommonAttentionMetadata.req_idx``). The processor of each
runner says which (``DAHost.row_keys``) and brings its trackers up to date for the step
(``DAHost.refresh``: nothing in V1, whose output lists are live; one device gather of
the newest tokens in V2).

What it leaves alone, on purpose: prefill rows; groups whose reads are already bounded
(sliding-window, chunked-local, cross and encoder attention); every step without DA
rows; the shared tensors themselves (they are copied). What it cannot do is said, never
silently skipped: an engine feature under which a compacted table would not reach the
kernel (``support.engine_blockers``: full CUDA graphs, speculative decoding, ...) is
warned once and every DA request reports ``reads_restricted`` false; a group it cannot
restrict is warned once; a step it passes over is noted in the request's report.

Cascade (common-prefix) attention is turned off for a step with compacted rows: a
prefix shared by the batch is no longer a prefix of a compacted row.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from declattn.vllm import link, support
from declattn.vllm.compact import compact_rows
from declattn.vllm.state import DAState, log, plugin_enabled


class DAHost(Protocol):
    """What the builder wrapper needs from an engine's DA processor, either runner's."""

    state: DAState

    def row_keys(self, cm: Any) -> Sequence[int] | None:
        """The tracker key of each batch row of ``cm`` (None: rows cannot be mapped)."""
        ...

    def refresh(self, cm: Any, rows: Sequence[int]) -> None:
        """Bring the trackers of batch ``rows`` up to this step's tokens."""
        ...


def install() -> list[str]:
    """Wrap every supported builder that this vLLM has; safe to call more than once.

    Returns the builders now wrapped. A backend whose module does not import here
    (FlashAttention on a CPU build) is skipped.
    """
    done = []
    for module_name, class_name in support.WRAPPED_BUILDERS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a backend this build lacks, or one that needs a GPU library
            continue
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        if not support.builder_wrapped(cls):
            cls.build = _wrap(cls.build)
            if getattr(cls, "supports_update_block_table", False):
                # The V1 runner would reuse one group's metadata for another group by
                # swapping in that group's block table, keeping our compacted lengths.
                cls.supports_update_block_table = False
        done.append(class_name)
    return done


def _wrap(build: Callable) -> Callable:
    @functools.wraps(build)
    def wrapped(self: Any, common_prefix_len: int, common_attn_metadata: Any,
                fast_build: bool = False, *args: Any, **kwargs: Any) -> Any:
        host = link.lookup(self.vllm_config)
        if host is None:
            _check_unattached(self.vllm_config)
        elif host.state.rows:
            compacted = _compact(self, host, common_attn_metadata)
            if compacted is not None:
                return build(self, 0, compacted, fast_build, *args, **kwargs)
        return build(self, common_prefix_len, common_attn_metadata, fast_build, *args, **kwargs)

    setattr(wrapped, support.WRAP_MARK, True)
    return wrapped


_CHECKED: set[int] = set()


def _check_unattached(vllm_config: Any) -> None:
    """An engine whose builders run without a DA processor: say so where that means DA
    requests would run plain (vLLM's V1 runner drops logits-processor plugins under
    speculative decoding), once per engine."""
    key = id(vllm_config)
    if key in _CHECKED:
        return
    _CHECKED.add(key)
    if plugin_enabled() and vllm_config.speculative_config is not None:
        log.warning(
            "declattn: speculative decoding is on, and vLLM's V1 runner then loads no "
            "logits-processor plugin: DA requests on this engine run as plain requests "
            "(tags are not read, nothing is skipped). Turn speculative decoding off for DA."
        )


def _block_size(builder: Any) -> int:
    return int(builder.kv_cache_spec.block_size)


def _decode_rows(host: DAHost, cm: Any) -> list[tuple[int, Any, int]]:
    """``(row, tracker, length)`` for the step's DA rows that decode one token."""
    keys = host.row_keys(cm)
    lens = cm.seq_lens_cpu_upper_bound
    if keys is None or lens is None:
        return []
    rows = host.state.rows
    qsl = cm.query_start_loc_cpu
    prefilling = cm.is_prefilling
    out = []
    for row in range(int(cm.num_reqs)):
        tracker = rows.get(int(keys[row]))
        if tracker is None or int(qsl[row + 1] - qsl[row]) != 1:
            continue
        if prefilling is not None and bool(prefilling[row]):
            continue
        out.append((row, tracker, int(lens[row])))
    return out


def _compact(builder: Any, host: DAHost, cm: Any) -> Any | None:
    """A copy of the common metadata with the DA decode rows compacted; None if none."""
    decode = _decode_rows(host, cm)
    if not decode:
        return None
    state = host.state
    if state.blockers():
        return None  # warned once; every DA request's report carries the cause
    info = state.group(builder)
    if not info.verdict.ok:
        if not info.verdict.by_design:
            for _, tracker, length in decode:
                tracker.note(length, f"KV-cache group {info.index}: {info.verdict.reason}")
        return None
    host.refresh(cm, [row for row, _, _ in decode])
    bs = _block_size(builder)
    width = int(cm.block_table_tensor.shape[1])
    kept: dict[int, tuple[int, ...]] = {}
    lengths: dict[int, int] = {}
    for row, tracker, length in decode:
        blocks = tracker.kept_blocks(length, bs)
        if blocks is None:
            if tracker.masking:  # DA-nm reads everything by design
                tracker.note(length, "the step's length is not the tracked request's "
                                     "(a recompute after preemption, or a lagging output)")
            continue
        if blocks[-1] >= width:
            tracker.note(length, "the block table is narrower than the sequence")
            continue
        kept[row], lengths[row] = blocks, length  # a global step compacts to itself
    if not kept:
        return None
    out = compact_rows(cm.block_table_tensor, cm.seq_lens, lengths, kept, bs)
    upper = cm.seq_lens_cpu_upper_bound.clone()
    for row, n in out.lengths.items():
        upper[row] = n
    trackers = {row: tracker for row, tracker, _ in decode}
    for row, blocks in kept.items():
        trackers[row].record(lengths[row], blocks, out.physical_of(row), out.lengths[row],
                             info.index, info.token_bytes, bs)
    return dataclasses.replace(
        cm,
        block_table_tensor=out.block_table,
        seq_lens=out.seq_lens,
        seq_lens_cpu_upper_bound=upper,
        max_seq_len=_max_len(upper, int(cm.num_reqs)),
    )


def _max_len(upper: Any, num_reqs: int) -> int:
    """The longest row after compaction, from CPU values (no device sync)."""
    values = upper[:num_reqs].tolist()
    return max(values) if values else 0
