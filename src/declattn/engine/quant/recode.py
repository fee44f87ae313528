"""New weights into a GGUF tensor's own blocks: each group keeps its scale and offset,
only the integer codes are chosen again.

Why keep the scales: a merged adapter moves a weight by far less than the spread of its
group, so the file's scale and offset still describe the group; re-rounding the codes
against them reproduces the base weight exactly where the adapter did not move it
across half a step, and nowhere adds the error of a second, fresh quantisation of the
already-quantised base (which re-fitting every scale would). The blocks keep their
format and size, so a merged model decodes at the base model's speed, and llama.cpp
reads the file as it reads the base.

``encode`` is the exact inverse of ``blocks._decode`` for the formats below: decoding
a tensor and encoding its codes again gives back its bytes (tests check it on the
shipped models' tensors).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from declattn.engine.quant.blocks import group_codes

Q = GGMLQuantizationType

RECODABLE: frozenset[Q] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K})
"""Formats whose codes ``encode`` writes back (every format of the shipped GGUFs)."""


def _pack_nibbles(codes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of ``blocks._nibbles``: per run of ``2 * width`` codes, the first
    ``width`` in the low nibbles of ``width`` bytes, the next ``width`` in the high."""
    n = codes.shape[0]
    c = codes.reshape(n, -1, 2, width).astype(np.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, -1)


def _fifth_bits(codes: np.ndarray) -> np.ndarray:
    """Bit 4 of each of a block's 32 codes as a little-endian uint32, as 4 bytes."""
    bits = ((codes >> 4) & 1).astype(np.uint32)
    word = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return word.astype("<u4").view(np.uint8).reshape(-1, 4)


def encode(kind: Q, blocks: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``blocks`` ``[n, type_size]`` with their codes replaced by ``codes`` ``[n, block]``
    (scale and offset bytes kept)."""
    out = blocks.copy()
    c = codes.astype(np.uint8)
    if kind in (Q.Q4_0,):
        out[:, 2:] = _pack_nibbles(c, 16)
    elif kind == Q.Q4_1:
        out[:, 4:] = _pack_nibbles(c, 16)
    elif kind == Q.Q5_0:
        out[:, 2:6] = _fifth_bits(c)
        out[:, 6:] = _pack_nibbles(c & 0x0F, 16)
    elif kind == Q.Q8_0:
        out[:, 2:] = (c.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    elif kind == Q.Q4_K:
        out[:, 16:] = _pack_nibbles(c, 32)
    elif kind == Q.Q6_K:
        n = c.shape[0]
        out[:, :128] = _pack_nibbles(c & 0x0F, 64)
        high = (c >> 4).reshape(n, 2, 4, 32)  # two runs of 32 bytes, four 2-bit fields
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        out[:, 128:192] = np.bitwise_or.reduce(high << shifts, axis=2).reshape(n, 64)
    else:
        raise NotImplementedError(f"{kind.name} codes are not written back")
    return out


def rerounded(raw: np.ndarray, kind: Q, weight: np.ndarray) -> np.ndarray:
    """The bytes of ``raw`` (one tensor of format ``kind``) with every code chosen again
    for ``weight`` ``[rows, cols]`` against the group's own scale and offset; shaped as
    ``raw``. A group of scale 0 keeps its codes."""
    if kind not in RECODABLE:
        raise NotImplementedError(f"{kind.name} codes are not written back")
    rows, cols = weight.shape
    g = group_codes(raw, kind, (rows, cols))
    w = weight.reshape(rows, cols // g.group, g.group).astype(np.float32)
    scale, offset = g.scale[..., None], g.offset[..., None]
    safe = np.where(scale != 0, scale, 1.0)
    fresh = np.clip(np.rint((w - offset) / safe), 0, (1 << g.bits) - 1)
    old = g.codes.reshape(fresh.shape)
    codes = np.where(scale != 0, fresh, old).astype(np.uint8)
    block, type_size = GGML_QUANT_SIZES[kind]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size)
    return encode(kind, blocks, codes.reshape(-1, block)).reshape(np.shape(raw))
