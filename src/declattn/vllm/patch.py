"""The skipping: a wrapper around attention metadata builders' ``build``.

Before the stock builder turns the step's common metadata into its backend's metadata,
the wrapper asks the engine's DA processor which rows are DA decode rows and which
logical blocks each may read, and hands the builder a copy of the metadata whose block
table rows and sequence lengths are compacted to those blocks (``compact.py``). The
stock kernel then reads fewer pages; it is not changed.

What it leaves alone, on purpose:

- prefill rows (more than one query token, or a request still prefilling): every mode
  attends fully during prefill;
- sliding-window, chunked-local and cross/encoder layer groups: their reads are already
  bounded or are not the decoder's KV;
- every row of a step on a builder it does not know, and every step without DA rows
  (the stock ``build`` runs on the untouched metadata);
- the shared tensors themselves: they are copied, since one block table or length
  tensor can serve several KV-cache groups and the runner's persistent buffers.

Cascade (common-prefix) attention is turned off for a step with compacted rows: a
prefix shared by the batch is no longer a prefix of a compacted row.

The CPU builder (``CPU_ATTN``) is the one tested. The FlashAttention and Triton
wrappers are the same code on the same metadata fields, but have NOT been run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

from declattn.vllm import link
from declattn.vllm.compact import compact_rows

BUILDERS: tuple[tuple[str, str, bool], ...] = (
    # module, class, tested on real hardware
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder", True),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder", False),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder", False),
)

_MARK = "__declattn_wrapped__"


def install() -> list[str]:
    """Wrap every known builder that this vLLM has; safe to call more than once.

    Returns the builders now wrapped. A backend whose module does not import here
    (FlashAttention on a CPU build) is skipped.
    """
    done = []
    for module_name, class_name, _tested in BUILDERS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a backend this build lacks, or one that needs a GPU library
            continue
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        if not getattr(cls.build, _MARK, False):
            cls.build = _wrap(cls.build)
            if getattr(cls, "supports_update_block_table", False):
                # The runner would reuse one group's metadata for another group by
                # swapping in that group's block table, keeping our compacted lengths.
                cls.supports_update_block_table = False
        done.append(class_name)
    return done


def _wrap(build: Callable) -> Callable:
    @functools.wraps(build)
    def wrapped(self: Any, common_prefix_len: int, common_attn_metadata: Any,
                fast_build: bool = False, *args: Any, **kwargs: Any) -> Any:
        processor = link.lookup(getattr(self, "vllm_config", None))
        if processor is not None and processor.rows and _eligible(self):
            compacted = _compact(self, processor, common_attn_metadata)
            if compacted is not None:
                return build(self, 0, compacted, fast_build, *args, **kwargs)
        return build(self, common_prefix_len, common_attn_metadata, fast_build, *args, **kwargs)

    setattr(wrapped, _MARK, True)
    return wrapped


def _eligible(builder: Any) -> bool:
    """A full-attention decoder group whose every layer reads its whole past."""
    cached = builder.__dict__.get("_declattn_eligible")
    if cached is not None:
        return cached
    ok = _full_attention(builder)
    builder.__dict__["_declattn_eligible"] = ok
    return ok


def _full_attention(builder: Any) -> bool:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = builder.kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or type(spec).__name__ != "FullAttentionSpec":
        return False  # MLA, R-SWA, cross and encoder-only specs are left alone
    if getattr(spec, "sliding_window", None) is not None:
        return False
    if getattr(spec, "attention_chunk_size", None) is not None:
        return False
    if getattr(builder, "window_size", -1) not in (-1, None):
        return False
    if getattr(builder, "is_cross_attention", False):
        return False
    if getattr(builder, "is_encoder_only_attention", False):
        return False
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(builder.vllm_config, Attention, builder.layer_names)
    except Exception:
        return False
    for layer in layers.values():
        window = getattr(getattr(layer, "impl", None), "sliding_window", None)
        if window not in (None, -1):
            return False  # a group mixing windowed and global layers
        if str(getattr(layer, "attn_type", "decoder")).lower().split(".")[-1] != "decoder":
            return False
    return True


def _block_size(builder: Any) -> int:
    return int(getattr(builder, "block_size", None) or builder.kv_cache_spec.block_size)


def _compact(builder: Any, processor: Any, cm: Any) -> Any | None:
    """A copy of the common metadata with the DA decode rows compacted; None if none."""
    if getattr(cm, "dcp_local_seq_lens", None) is not None:
        return None  # decode context parallelism splits rows across ranks: not handled
    bs = _block_size(builder)
    num_reqs = int(cm.num_reqs)
    qsl = cm.query_start_loc_cpu
    lens_cpu = cm.seq_lens_cpu_upper_bound
    if lens_cpu is None:
        lens_cpu = cm.seq_lens.cpu()
    prefilling = cm.is_prefilling.cpu() if cm.is_prefilling is not None else None
    table = cm.block_table_tensor
    kept: dict[int, tuple[int, ...]] = {}
    for row in processor.rows:
        if row >= num_reqs or int(qsl[row + 1] - qsl[row]) != 1:
            continue
        if prefilling is not None and bool(prefilling[row]):
            continue
        length = int(lens_cpu[row])
        blocks = processor.kept_blocks(row, length, bs)
        if blocks is None or -(-length // bs) > table.shape[1]:
            continue
        kept[row] = blocks  # a global step compacts to itself, and is still counted
    if not kept:
        return None
    lengths = {row: int(lens_cpu[row]) for row in kept}
    out = compact_rows(table, cm.seq_lens, lengths, kept, bs)
    upper = None
    if cm.seq_lens_cpu_upper_bound is not None:
        upper = cm.seq_lens_cpu_upper_bound.clone()
        for row, n in out.lengths.items():
            upper[row] = n
    max_len = _max_len(cm, out.lengths)
    for row, blocks in kept.items():
        processor.record(row, builder, lengths[row], blocks, out.physical[row], out.lengths[row])
    return dataclasses.replace(
        cm,
        block_table_tensor=out.block_table,
        seq_lens=out.seq_lens,
        seq_lens_cpu_upper_bound=upper,
        max_seq_len=max_len,
    )


def _max_len(cm: Any, new: dict[int, int]) -> int:
    """The longest row after compaction, from CPU values (no device sync)."""
    lens = cm.seq_lens_cpu_upper_bound
    if lens is None:
        return int(cm.max_seq_len)
    values = lens[: int(cm.num_reqs)].tolist()
    for row, n in new.items():
        values[row] = n
    return max(values) if values else 0

