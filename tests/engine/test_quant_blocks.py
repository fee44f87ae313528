"""GGUF block formats read into codes + scale + offset agree with gguf-py's dequantize."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_samples import gguf_blocks

from declattn.engine.quant.blocks import DECODABLE, group_codes

Q = GGMLQuantizationType
ROWS, COLS = 6, 512


def _blocks(kind: Q, rng: np.random.Generator) -> np.ndarray:
    return gguf_blocks(kind, ROWS, COLS, rng)


@pytest.mark.parametrize("kind", sorted(DECODABLE, key=lambda k: k.name), ids=lambda k: k.name)
def test_codes_dequantize_like_gguf(kind):
    raw = _blocks(kind, np.random.default_rng(int(kind)))
    g = group_codes(raw, kind, (ROWS, COLS))
    reference = dequantize(raw, kind).reshape(ROWS, COLS)
    assert g.codes.dtype == np.uint8 and int(g.codes.max()) < 2**g.bits
    assert g.scale.shape == g.offset.shape == (ROWS, COLS // g.group)
    np.testing.assert_allclose(g.dequantize(), reference, rtol=1e-6, atol=1e-6)
    assert len(np.unique(g.codes)) > 2**g.bits // 2  # the codes are really used


def test_four_bit_formats_are_four_bits_in_groups_of_32():
    rng = np.random.default_rng(0)
    for kind in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        g = group_codes(_blocks(kind, rng), kind, (ROWS, COLS))
        assert (g.bits, g.group) == (4, 32)


def test_row_reorder_moves_codes_and_scales_together():
    raw = _blocks(Q.Q4_K, np.random.default_rng(1))
    g = group_codes(raw, Q.Q4_K, (ROWS, COLS))
    order = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(g.take_rows(order).dequantize(), g.dequantize()[order])


def test_wrong_sizes_are_refused():
    raw = _blocks(Q.Q8_0, np.random.default_rng(2))
    with pytest.raises(ValueError, match="blocks for a"):
        group_codes(raw, Q.Q8_0, (ROWS + 1, COLS))
    with pytest.raises(ValueError, match="whole blocks"):
        group_codes(raw, Q.Q8_0, (ROWS, COLS + 16))
    with pytest.raises(NotImplementedError, match="IQ4_NL"):
        group_codes(raw, Q.IQ4_NL, (ROWS, COLS))
