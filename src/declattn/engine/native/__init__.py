"""The native extension: every kernel of the engine in one torch op library,
``torch.ops.declattn``, built per CPU variant when the package is built (``build.py``,
``variants.py``) and loaded once per process, the best variant this CPU runs (``load.py``).

The ops: ``decode_attention`` (``csrc/decode_attn.cpp``), ``store_rows``
(``csrc/kv_store.cpp``), ``rms_norm`` and ``rotary`` (``csrc/norm_rope.cpp``), the GGUF
matmul ops (``csrc/gguf_matmul.cpp``), the ``DecodeStack`` class (``csrc/decode_layer.cpp``:
a GGUF model's decode step in one call), greedy sampling's ``argmax`` (``csrc/argmax.cpp``),
``build_info`` (``csrc/library.cpp``).

Each concern keeps its switch to its torch code (``DECLATTN_DECODE_KERNEL``,
``DECLATTN_GGUF_KERNEL``, ``DECLATTN_LAYER_KERNEL`` ``=torch``: chosen, no warning); where
the library cannot be had at all, every caller runs its torch code after one warning.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from declattn.engine.native.build import KernelBuildError
from declattn.engine.native.load import ENV_CHOICE, Library, library
from declattn.engine.native.variants import cpu_flags

__all__ = [
    "ENV_CHOICE", "ENV_SWITCH", "SCORINGS", "KernelBuildError", "Library", "cpu_flags",
    "decode_bf16_path", "decode_op", "decode_scoring", "library", "op_paths", "ops",
    "store_op",
]

ENV_SWITCH = "DECLATTN_DECODE_KERNEL"
"""The switch of decode attention and of the native KV store it goes with."""

DecodeOp = Callable[..., Tensor]
"""``(q, kp, vp, runs, offsets, scale, min_split_rows, scoring=0) -> out``."""


def ops(switch: str) -> Any:
    """``torch.ops.declattn``, loading the library on first use; ``None`` where
    ``switch`` is ``torch`` (chosen: no warning) or the library cannot be had (one
    warning, from ``library``)."""
    choice = os.environ.get(switch, "native").lower()
    if choice == "torch":
        return None
    if choice != "native":
        raise ValueError(f"{switch} must be 'native' or 'torch', not {choice!r}")
    return torch.ops.declattn if library() is not None else None


@functools.cache
def decode_op() -> DecodeOp | None:
    """``decode_attention``, or ``None`` (decode attention then runs on torch ops)."""
    found = ops(ENV_SWITCH)
    return None if found is None else found.decode_attention


@functools.cache
def store_op() -> Callable[..., None] | None:
    """``store_rows(kp, vp, k, v, row)``: a step's new keys and values into a layer's
    pools in one call; ``None`` where decode attention is switched to torch (the switch
    of the path it serves) or the library cannot be had."""
    found = ops(ENV_SWITCH)
    return None if found is None else found.store_rows


def decode_bf16_path() -> bool:
    """Whether decode attention takes bf16 queries over a bf16 pool through its AVX-512
    BF16 path (``csrc/decode_attn_avx512.h``); ``False`` where the variant lacks it."""
    return decode_op() is not None and bool(torch.ops.declattn.decode_bf16_path())


SCORINGS = {"machine": 0, "vdpbf16ps": 1, "fma": 2, "amx": 3}
"""The kernel's ``scoring`` argument: how its AVX-512 BF16 path scores keys and weights
values (the CPU's choice by default; the others for tests; ``amx`` is refused where the
CPU, build or OS lacks it)."""


def decode_scoring() -> str:
    """How the AVX-512 BF16 path works on this CPU: ``amx`` (AMX tiles, where the variant
    has them and Linux grants them: ``csrc/decode_attn_amx.h``), else ``vdpbf16ps`` (AMD)
    or ``fma`` (Intel); ``""`` where there is no such path."""
    return str(torch.ops.declattn.decode_scoring()) if decode_bf16_path() else ""


def op_paths() -> dict[str, str]:
    """Each native op and the CPU code it runs here (``declattn doctor``)."""
    lib = library()
    if lib is None:
        return {"all": "torch ops (the native library is unavailable)"}
    isa = set(lib.isa)
    vec = "AVX-512" if "avx512f" in isa else "AVX2" if "avx2" in isa else "portable C++"
    if "avx512_vnni" in isa:
        gguf = "AVX-512 VNNI (16-row groups)"
    else:
        gguf = "AVX2 (8-row groups)" if "avx2" in isa else "portable C++"
    bf16 = decode_scoring()
    attn = f"AVX-512 BF16 by {bf16} for bf16, " if bf16 else ""
    return {
        "decode_attention": f"{attn}{vec} vectors otherwise",
        "store_rows": "memcpy",
        "rms_norm, rotary": f"{vec} (compiler-vectorised)",
        "argmax (greedy)": f"{vec} (vector extensions)",
        "gguf_linear": gguf,
        "DecodeStack": f"the ops above, {vec} elementwise between them",
    }
