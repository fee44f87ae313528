"""GGUF for the engine's tests: tensors in block formats for the quantization tests
(``test_quant_*``), and a shipped file's header read by transformers' reader.

gguf-py quantizes the legacy formats; it cannot write K formats, so those are random
bytes with finite fp16 super-scales (every bit pattern of the rest is a valid block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

Q = GGMLQuantizationType

_K_HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
"""Byte offsets of each K format's fp16 super-scales (d, and dmin where there is one)."""


def gguf_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A ``[rows, row_bytes]`` uint8 tensor of format ``kind``."""
    if kind not in _K_HALVES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[0] += 3.0  # an offset, for the formats with a min
        return quantize(w, kind)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _K_HALVES[kind]:
        halves = rng.uniform(0.001, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_header(path: Path) -> tuple[Any, dict[str, Any], list[tuple[Any, ...]], int]:
    """A GGUF file's bytes (mapped), its metadata, its tensor table (name, shape, type,
    offset per tensor) and the byte where that table ends, read by transformers' own GGUF
    reader: independent of
    our converter, and without gguf-py's ``GGUFReader``, which spends seconds turning a
    tokenizer's arrays into fields first."""
    from transformers.integrations.gguf import reader

    blob = reader._mapped(str(path))
    metadata, tensor_count, pos = reader._read_metadata(blob, str(path))
    entries, end = reader._read_tensor_table(blob, tensor_count, pos)
    return blob, metadata, entries, end
