"""The GGUF block matmul (``engine/csrc/gguf_matmul.cpp``), and the layer ops that call it
(``engine/csrc/decode_layer.cpp``): part of the native extension (``engine/native``).

Where the extension cannot be had, GGUF layers fall back to torch's packed int4/int8
kernels (``linear.py``), after the extension's one warning; ``DECLATTN_GGUF_KERNEL=torch``
chooses that fallback on purpose, without the warning.
"""

from __future__ import annotations

import functools
from typing import Any

from declattn.engine import native
from declattn.engine.models.fused import layer_ops

LAYER_SWITCH = "DECLATTN_LAYER_KERNEL"
"""The switch of the norm/RoPE kernel (``models/fused.py``), which the layer ops call."""
ENV_SWITCH = "DECLATTN_GGUF_KERNEL"
NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
"""ggml type ids the kernel multiplies by directly."""
REGROUPED = {
    1006: ("Q5_0", 8), 1008: ("Q8_0", 8), 2006: ("Q5_0", 16), 2008: ("Q8_0", 16),
    2012: ("Q4_K", 16), 2014: ("Q6_K", 16),
}
"""Our ids of the layouts ``gguf_repack`` regroups a matrix into at load: the file's format
each holds and the rows of a group (sixteen: AVX-512 VNNI, ``gguf_rows16_vnni.h`` and
``gguf_k_rows16.h``; eight: AVX2, ``gguf_q5_0_rows8.h``, ``gguf_q8_0_rows8.h``)."""


@functools.cache
def gguf_ops() -> Any:
    """``torch.ops.declattn`` for ``gguf_linear``, ``gguf_dequantize`` and the rest;
    ``None`` where ``DECLATTN_GGUF_KERNEL=torch`` or the extension is unavailable."""
    return native.ops(ENV_SWITCH)


@functools.cache
def decode_layer_ops() -> Any:
    """``torch.ops.declattn`` for ``DecodeStack`` (a GGUF model's decode step in one
    call, ``decode_layers.py``);
    ``None`` where ``DECLATTN_LAYER_KERNEL=torch``, or where either kind of op it calls
    (the GGUF matmul, norm/RoPE) is switched off."""
    if gguf_ops() is None or layer_ops() is None:
        return None
    return native.ops(LAYER_SWITCH)
