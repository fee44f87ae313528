"""Codes written back into GGUF blocks: the exact inverse of the block decoder, and new
weights re-rounded against each group's own scale and offset."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf_samples import gguf_blocks

from declattn.engine.quant.blocks import group_codes
from declattn.engine.quant.recode import RECODABLE, encode, rerounded

Q = GGMLQuantizationType
ROWS, COLS = 6, 512
KINDS = sorted(RECODABLE, key=lambda k: k.name)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_encoding_the_decoded_codes_gives_the_bytes_back(kind: Q) -> None:
    raw = gguf_blocks(kind, ROWS, COLS, np.random.default_rng(int(kind)))
    g = group_codes(raw, kind, (ROWS, COLS))
    block, size = GGML_QUANT_SIZES[kind]
    blocks = raw.reshape(-1, size)
    assert np.array_equal(encode(kind, blocks, g.codes.reshape(-1, block)), blocks)
    assert np.array_equal(rerounded(raw, kind, g.dequantize()), raw)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_any_codes_survive_encoding(kind: Q) -> None:
    rng = np.random.default_rng(7)
    raw = gguf_blocks(kind, ROWS, COLS, rng)
    g = group_codes(raw, kind, (ROWS, COLS))
    block, size = GGML_QUANT_SIZES[kind]
    codes = rng.integers(0, 2**g.bits, g.codes.shape, dtype=np.uint8)
    out = encode(kind, raw.reshape(-1, size), codes.reshape(-1, block))
    back = group_codes(out, kind, (ROWS, COLS))
    assert np.array_equal(back.codes, codes)
    assert np.array_equal(back.scale, g.scale) and np.array_equal(back.offset, g.offset)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_step_moves_a_code_and_half_a_step_does_not(kind: Q) -> None:
    raw = gguf_blocks(kind, ROWS, COLS, np.random.default_rng(3))
    g = group_codes(raw, kind, (ROWS, COLS))
    step = np.repeat(g.scale, g.group, axis=1)
    room = (g.codes < 2**g.bits - 1) & (step > 0)
    w = g.dequantize() + np.where(room, step, 0) + np.where(~room, 0.4 * step, 0)
    new = group_codes(rerounded(raw, kind, w), kind, (ROWS, COLS))
    assert np.array_equal(new.codes[room], g.codes[room] + 1)
    assert np.array_equal(new.codes[~room], g.codes[~room])


@pytest.mark.model
def test_real_tensors_round_trip() -> None:
    """Every recodable format of the shipped qwen2.5-0.5b and smollm2-135m files."""
    from declattn.engine.gguf_convert import open_gguf
    from declattn.engine.registry import MODELS, resolve_model

    seen = set()
    for name in ("qwen2.5-0.5b", "smollm2-135m"):
        if not MODELS[name].installed():
            continue
        tensors = sorted(open_gguf(resolve_model(name)).reader.tensors, key=lambda t: t.n_bytes)
        for t in tensors:  # the smallest of each format
            kind = Q(t.tensor_type)
            if kind not in RECODABLE or kind in seen:
                continue
            seen.add(kind)
            rows, cols = int(t.shape[1]), int(t.shape[0])
            g = group_codes(t.data, kind, (rows, cols))
            assert np.array_equal(rerounded(t.data, kind, g.dequantize()), np.asarray(t.data))
    if not seen:
        pytest.skip("no shipped GGUF installed")
    assert {Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1} <= seen
