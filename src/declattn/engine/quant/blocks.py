"""GGUF block formats -> integer codes with a scale and an offset per group.

Every legacy and K-quant format of llama.cpp stores a weight as ``scale * code + offset``
for a group of 16 or 32 consecutive weights of a row, with small unsigned (or signed)
integer codes. Reading a tensor into that one form, instead of dequantising it, lets
a 4-bit format go to a 4-bit kernel code for code; only the per-group scale and offset
are rounded (to the kernel's bf16). The arithmetic follows gguf-py's ``dequantize``
(``gguf/quants.py``), stopping before the multiplication; tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

_QK_K = 256


@dataclass
class GroupCodes:
    """A ``[rows, cols]`` weight as ``scale * code + offset`` per group of ``group`` columns.

    ``codes``: uint8 ``[rows, cols]`` in ``[0, 2**bits)``; ``scale``, ``offset``: float32
    ``[rows, cols // group]``.
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """The float32 weight (what gguf-py's ``dequantize`` returns, to float rounding)."""
        rows, cols = self.shape
        c = self.codes.reshape(rows, cols // self.group, self.group).astype(np.float32)
        w = c * self.scale[..., None] + self.offset[..., None]
        return w.reshape(rows, cols)

    def take_rows(self, order: np.ndarray) -> GroupCodes:
        """The same weight with its rows reordered (llama.cpp's q/k row permutation)."""
        return GroupCodes(
            self.codes[order], self.scale[order], self.offset[order], self.group, self.bits
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """``qs`` ``[n, bytes]`` -> ``[n, 2 * bytes]``: for each run of ``width`` bytes, the
    low nibbles come first, then the high ones (the order every ggml 4-bit format uses)."""
    shifted = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1)


def _fifth_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1: bit ``i`` of a block's little-endian uint32 is the top bit of code ``i``."""
    h = np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1)
    return ((h >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins packed in 12 bytes."""
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(kind: Q, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Blocks ``[n, type_size]`` -> (codes ``[n, block]``, scale, offset ``[n, groups]``,
    group, bits)."""
    n = b.shape[0]
    if kind == Q.Q4_0:  # w = d * (q - 8)
        d = _f16(b[:, :2])
        return _nibbles(b[:, 2:], n, 16), d, -8 * d, 32, 4
    if kind == Q.Q4_1:  # w = d * q + m
        return _nibbles(b[:, 4:], n, 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 32, 4
    if kind == Q.Q5_0:  # w = d * (q - 16)
        d = _f16(b[:, :2])
        codes = _nibbles(b[:, 6:], n, 16) | (_fifth_bits(b[:, 2:6], n) << 4)
        return codes, d, -16 * d, 32, 5
    if kind == Q.Q5_1:  # w = d * q + m
        codes = _nibbles(b[:, 8:], n, 16) | (_fifth_bits(b[:, 4:8], n) << 4)
        return codes, _f16(b[:, :2]), _f16(b[:, 2:4]), 32, 5
    if kind == Q.Q8_0:  # w = d * q, q signed
        d = _f16(b[:, :2])
        codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 32, 8
    if kind in (Q.Q4_K, Q.Q5_K):  # w = (d * sc) * q - dmin * m, eight groups of 32
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16], n)
        if kind == Q.Q4_K:
            codes, bits = _nibbles(b[:, 16:], n, 32), 4
        else:
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = _nibbles(b[:, 48:], n, 32) | (((qh & 1).reshape(n, -1)) << 4)
            bits = 5
        return codes, d * sc, -(dmin * mn), 32, bits
    if kind == Q.Q6_K:  # w = (d * sc) * (q - 32), sixteen groups of 16
        ql, qh = b[:, :128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        low = _nibbles(ql, n, 64).reshape(n, -1, 32)
        high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 4, 1
        )
        codes = low | ((high & 3).reshape(n, -1, 32) << 4)
        scale = d * sc
        return codes.reshape(n, _QK_K), scale, -32 * scale, 16, 6
    raise NotImplementedError(kind.name)


DECODABLE: frozenset[Q] = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
"""Formats read into codes here; any other quantized type is dequantised by gguf-py."""


def group_codes(raw: np.ndarray, kind: Q, shape: tuple[int, int]) -> GroupCodes:
    """Decode one GGUF tensor's bytes (``[rows, row_bytes]`` or flat) of format ``kind``
    into codes for a ``shape = (rows, cols)`` weight."""
    if kind not in DECODABLE:
        raise NotImplementedError(f"{kind.name} is not decoded into codes")
    rows, cols = shape
    block, type_size = GGML_QUANT_SIZES[kind]
    if cols % block:
        raise ValueError(f"{kind.name}: {cols} columns are not whole blocks of {block}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size)
    if blocks.shape[0] != rows * cols // block:
        raise ValueError(f"{kind.name}: {blocks.shape[0]} blocks for a {rows}x{cols} tensor")
    codes, scale, offset, group, bits = _decode(kind, blocks)
    return GroupCodes(
        codes.reshape(rows, cols),
        scale.reshape(rows, cols // group).astype(np.float32),
        offset.reshape(rows, cols // group).astype(np.float32),
        group,
        bits,
    )
