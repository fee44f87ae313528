"""The GGUF block matmul (``csrc/gguf_matmul.cpp``): built once per machine through the
same build path as the decode-attention kernel (``engine/native.py``: one compiler policy,
one cache layout, one warning on failure).

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

from declattn.engine.native import load_op

SOURCE = Path(__file__).with_name("csrc") / "gguf_matmul.cpp"
ENV_SWITCH = "DECLATTN_GGUF_KERNEL"
NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
"""ggml type ids the kernel multiplies by directly."""


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
