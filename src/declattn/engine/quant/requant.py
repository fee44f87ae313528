"""Codes of one GGUF format -> codes of a kernel's format, exactly where the bits allow.

A 4-bit GGUF group (Q4_0, Q4_1, Q4_K) is the int4 kernel's group: the codes pass as they
are and only scale and zero are rounded to bf16. Wider formats (5, 6, 8 bits) do not fit
four bits; they are rounded once more, either to int8 per row (almost exact: 255 levels
across a row) or to int4 per group of 32 (a quarter of int8's bytes, a coarser weight).
"""

from __future__ import annotations

import numpy as np
import torch

from declattn.engine.quant.blocks import GroupCodes
from declattn.engine.quant.linear import Int4Linear, Int8Linear

INT4_GROUP = 32


def int4_exact(g: GroupCodes, dtype: torch.dtype) -> Int4Linear:
    """A 4-bit, group-32 format as it is: ``scale * q + offset = (q - 8) * scale + zero``
    with ``zero = offset + 8 * scale``."""
    if g.bits != 4 or g.group != INT4_GROUP:
        raise ValueError(f"not a 4-bit group-{INT4_GROUP} format ({g.bits} bits, group {g.group})")
    codes = torch.from_numpy(g.codes)
    scale = torch.from_numpy(g.scale)
    zero = torch.from_numpy(g.offset + 8 * g.scale)
    return Int4Linear.from_codes(codes, scale, zero, INT4_GROUP, dtype)


def int4_rounded(w: np.ndarray, dtype: torch.dtype) -> Int4Linear:
    """Any float weight rounded to 16 levels between each 32-group's min and max."""
    rows, cols = w.shape
    grouped = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(rows, -1, 32)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scale = ((hi - lo) / 15).to(dtype).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (lo + 8 * scale).to(dtype).float()
    # round against the scale and zero the kernel will use, not the fp32 ones
    q = torch.round((grouped - zero[..., None]) / safe[..., None] + 8).clamp_(0, 15)
    return Int4Linear.from_codes(q.reshape(rows, cols), scale, zero, INT4_GROUP, dtype)


def int8_rounded(w: np.ndarray, dtype: torch.dtype) -> Int8Linear:
    """Any float weight rounded to int8 per row."""
    return Int8Linear.from_float(torch.from_numpy(np.ascontiguousarray(w)), dtype)
