"""Where DA really skips on a vLLM engine, where it cannot, and what fixes it.

Masking is not skipping, and a wrapper that runs but whose table never reaches the
kernel is worse than none: its read log would claim savings that did not happen. So
every way the plugin can fail to restrict reads is named here, once, for the one
warning the engine logs and for ``declattn doctor``:

- per KV-cache group (one attention metadata builder): is it a decoder group whose every
  layer reads its whole past, with a builder the plugin wraps? (``group_verdict``)
- per engine: a feature under which a compacted table never reaches the kernel
  (full CUDA graphs replay captured buffers) or the tracker cannot follow the request
  (speculative decoding, pipeline stages, context parallelism, async scheduling on the
  V1 runner). (``engine_blockers``)

Each "no" carries its cause and the setting that fixes it. Groups left alone on
purpose (sliding-window, chunked-local, cross- and encoder attention: their reads are
already bounded, or not the decoder's KV) say so too, but are no failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

V1 = "v1"
V2 = "v2"

WRAPPED_BUILDERS: tuple[tuple[str, str], ...] = (
    # module, class: builders whose ``build`` reads only the common metadata's block
    # table, sequence lengths and maximum length for the KV it attends over
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder"),
)
SUPPORTED_BACKENDS = "CPU_ATTN, FLASH_ATTN or TRITON_ATTN"
FIX_BACKEND = (
    "attention_config={'backend': 'TRITON_ATTN'} (or FLASH_ATTN; "
    "vllm serve: --attention-backend TRITON_ATTN)"
)
FIX_GRAPHS = (
    "compilation_config={'cudagraph_mode': 'PIECEWISE'} "
    "(vllm serve: -cc.cudagraph_mode=PIECEWISE), or enforce_eager=True"
)
WRAP_MARK = "__declattn_wrapped__"


@dataclass(frozen=True)
class Verdict:
    """Whether reads are restricted; if not, why, and what setting changes it.

    ``by_design``: left alone on purpose (the group's reads are already bounded)."""

    ok: bool
    reason: str = ""
    fix: str = ""
    by_design: bool = False

    def line(self) -> str:
        if self.ok:
            return "DA skips here"
        tail = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.reason}{tail}"


OK = Verdict(True)


def window_is_global(window: Any) -> bool:
    """Whether a layer's or an attention impl's window setting means "no window".

    Backends spell it differently: ``None`` (the model layer, FlexAttention), ``-1``
    (CPU_ATTN), ``(-1, -1)`` (FlashAttention, Triton, FlashInfer, ROCm: a pair of left
    and right extents, the left one negative). A window is anything else."""
    if window is None:
        return True
    if isinstance(window, tuple | list):
        return len(window) > 0 and int(window[0]) < 0
    return int(window) < 0


def builder_wrapped(builder_cls: type) -> bool:
    """Whether the plugin's wrapper runs in this builder class's ``build``."""
    return bool(getattr(builder_cls.build, WRAP_MARK, False))


def _spec_verdict(spec: Any) -> Verdict | None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    name = type(spec).__name__
    if not isinstance(spec, FullAttentionSpec):
        bounded = name in ("SlidingWindowSpec", "ChunkedLocalAttentionSpec",
                           "CrossAttentionSpec", "EncoderOnlyAttentionSpec")
        why = "reads already bounded or not the decoder's KV" if bounded else "not supported"
        return Verdict(False, f"{name} group ({why})", by_design=bounded)
    if type(spec) is not FullAttentionSpec:
        return Verdict(False, f"{name} group (MLA, sink or R-SWA layouts are not supported)")
    if spec.sliding_window is not None:
        return Verdict(False, "sliding-window layers (reads already bounded)", by_design=True)
    if spec.attention_chunk_size is not None:
        return Verdict(False, "chunked-local layers (reads already bounded)", by_design=True)
    if spec.non_causal:
        return Verdict(False, "non-causal attention")
    return None


def _layer_verdict(name: str, layer: Any) -> Verdict | None:
    from vllm.model_executor.layers.attention import Attention

    if type(layer) is not Attention:
        return Verdict(False, f"layer {name} is a {type(layer).__name__} (not plain attention)")
    if str(layer.attn_type).lower().split(".")[-1] != "decoder":
        return Verdict(False, f"layer {name} is {layer.attn_type} attention", by_design=True)
    if not window_is_global(layer.sliding_window):
        return Verdict(False, f"layer {name} has a {layer.sliding_window}-token window",
                       by_design=True)
    impl = layer.impl
    if not window_is_global(getattr(impl, "sliding_window", None)):
        return Verdict(False, f"layer {name}'s kernel has window {impl.sliding_window}",
                       by_design=True)
    if getattr(impl, "alibi_slopes", None) is not None:
        # the kernel derives ALiBi distances from key indices, which compaction renumbers
        return Verdict(False, f"layer {name} uses ALiBi (position bias inside the kernel)")
    return None


def group_verdict(builder: Any) -> Verdict:
    """Whether DA can restrict this builder's group: a full-attention decoder group,
    no window in any layer (in whatever convention its backend stores one), positions
    not used inside the kernel, and a builder the plugin wraps."""
    if not builder_wrapped(type(builder)):
        return Verdict(
            False,
            f"the {type(builder).__name__} backend is not wrapped by the DA plugin "
            f"(supported: {SUPPORTED_BACKENDS})",
            FIX_BACKEND,
        )
    verdict = _spec_verdict(builder.kv_cache_spec)
    if verdict is not None:
        return verdict
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    names = list(builder.layer_names)
    layers = get_layers_from_vllm_config(builder.vllm_config, AttentionLayerBase, names)
    if not names or set(layers) != set(names):
        return Verdict(False, "the group's layers are not all attention layers")
    for name, layer in layers.items():
        verdict = _layer_verdict(name, layer)
        if verdict is not None:
            return verdict
    return OK


def engine_blockers(vllm_config: Any, runner: str) -> list[Verdict]:
    """Engine-wide features under which DA decode rows cannot be restricted honestly.

    Read from the engine's config once its CUDA-graph mode is resolved (the first DA
    request, or the doctor after start-up)."""
    out: list[Verdict] = []
    for backend, n in unwrapped_backends(vllm_config).items():
        out.append(Verdict(
            False,
            f"{n} full-attention layers run on the {backend} backend, which the DA plugin "
            f"does not wrap (supported: {SUPPORTED_BACKENDS})",
            FIX_BACKEND,
        ))
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        out.append(Verdict(
            False,
            f"full CUDA graphs (cudagraph_mode={mode.name}): decode steps replay captured "
            "kernels on the runner's own block-table and length buffers, so a compacted "
            "table never reaches them",
            FIX_GRAPHS,
        ))
    if vllm_config.speculative_config is not None:
        out.append(Verdict(
            False,
            "speculative decoding: a step verifies several tokens per request, which the "
            "one-token-per-step tracker cannot follow (the V1 runner even drops "
            "logits-processor plugins)",
            "turn speculative decoding off (no speculative_config) for DA",
        ))
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        out.append(Verdict(
            False,
            f"pipeline parallelism ({pc.pipeline_parallel_size} stages): only the last "
            "stage samples, so earlier stages cannot follow the response",
            "use tensor parallelism instead (pipeline_parallel_size=1)",
        ))
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            out.append(Verdict(
                False,
                f"context parallelism ({name}={size}) splits a row's KV across ranks",
                f"{name}=1",
            ))
    if runner == V1 and vllm_config.scheduler_config.async_scheduling:
        out.append(Verdict(
            False,
            "async scheduling on the V1 runner: the step's metadata is built before the "
            "previous token is known, so the tracker's scope is one token behind",
            "async_scheduling=False (vllm serve: --no-async-scheduling)",
        ))
    return out


def unwrapped_backends(vllm_config: Any) -> dict[str, int]:
    """Layers DA would restrict (full-attention decoder layers) whose backend's builder
    the plugin does not wrap, counted by backend name. Needs the model built."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    out: dict[str, int] = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, Attention).items():
        if _layer_verdict(name, layer) is not None:
            continue
        backend = layer.get_attn_backend()
        if not builder_wrapped(backend.get_builder_cls()):
            out[backend.get_name()] = out.get(backend.get_name(), 0) + 1
    return out


def engine_notes(vllm_config: Any, runner: str) -> list[str]:
    """What works but deserves a line: costs and paths only read against the source."""
    notes = []
    if runner == V2 and vllm_config.scheduler_config.async_scheduling:
        notes.append(
            "async scheduling on the V2 runner: each step with DA rows copies their newest "
            "tokens to the host, which waits for the previous step (async overlap is lost "
            "for that step; --no-async-scheduling costs the same)"
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1:
        notes.append(
            f"tensor parallelism ({tp} ranks): every rank follows each DA request and "
            "compacts its own block table (read against the vLLM source, not run)"
        )
    return notes


def runner_of(vllm_config: Any) -> str:
    """Which model runner this engine's workers use."""
    return V2 if vllm_config.use_v2_model_runner else V1
