"""The GGUF block matmul (``csrc/gguf_matmul.cpp``), and the layer ops that call it
(``csrc/decode_layer.cpp``): built once per machine through the same build path as the
decode-attention kernel (``engine/native.py``: one compiler policy, one cache layout, one
warning on failure).

Built here rather than shipped for the same reasons: ``-march=native`` for the CPU that
runs it, against the torch installed. If it cannot be built, GGUF layers fall back to
torch's packed int4/int8 kernels (``linear.py``), with one warning naming cause and fix;
``DECLATTN_GGUF_KERNEL=torch`` chooses that fallback on purpose, without the warning.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from declattn.engine.models.fused import layer_ops
from declattn.engine.native import load_op

SOURCE = Path(__file__).with_name("csrc") / "gguf_matmul.cpp"
LAYER_SOURCE = Path(__file__).with_name("csrc") / "decode_layer.cpp"
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
    """``torch.ops.declattn_gguf`` (``gguf_linear``, ``gguf_dequantize``), built on first
    use; ``None`` (after one warning) when it cannot be had, or when
    ``DECLATTN_GGUF_KERNEL=torch``."""
    return load_op(
        SOURCE,
        lambda: torch.ops.declattn_gguf,
        ENV_SWITCH,
        "GGUF weights are re-rounded to torch's int4/int8 kernels (slower, and 5- to 8-bit "
        "formats lose precision)",
    )


@functools.cache
def decode_layer_ops() -> Any:
    """``torch.ops.declattn_decode_layer`` (``before_attention``, ``after_attention``: a
    GGUF layer's work around its attention in two calls, ``decode_layers.py``), built on
    first use; ``None`` (after one warning) when it cannot be had, or when
    ``DECLATTN_LAYER_KERNEL=torch``. Its ops call the GGUF and norm/RoPE kernels, so it is
    loaded only after both (``None`` where either is missing)."""
    if gguf_ops() is None or layer_ops() is None:
        return None
    return load_op(
        LAYER_SOURCE,
        lambda: torch.ops.declattn_decode_layer,
        LAYER_SWITCH,
        "a GGUF decode step runs its layers through the modules (a few ms more per step)",
    )
