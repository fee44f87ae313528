"""Dense weights kept while prompts prefill (``quant.linear.hold_dense``): the same numbers
as dequantising at every call, kept only while a prompt prefills, dropped after."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_engine, run_one

from declattn.engine import engine as engine_module
from declattn.engine.controller import Controller
from declattn.engine.loader import load_model
from declattn.engine.quant import GGUFLinear
from declattn.engine.quant.linear import GEMM_ROWS, hold_dense
from declattn.engine.registry import resolve_model
from declattn.engine.sampler import SamplingParams


@pytest.fixture(scope="module")
def packed():
    return load_model(resolve_model("smollm2-135m"), device="cpu")


def _gguf_layers(model: torch.nn.Module) -> list[GGUFLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


def _held(model: torch.nn.Module) -> int:
    return sum(m._dense is not None for m in _gguf_layers(model))


def test_a_kept_weight_gives_the_same_numbers_and_is_dropped(packed) -> None:
    model = packed.model
    layer = _gguf_layers(model)[0]
    dtype = next(model.parameters()).dtype
    x = torch.randn(GEMM_ROWS + 3, layer.in_features, generator=torch.Generator().manual_seed(0)
                    ).to(dtype)
    fresh = layer(x)
    assert layer._dense is None  # not kept unless asked
    try:
        assert hold_dense(model, True, dtype) > 0
        kept = layer(x)
        first = layer._dense
        assert first is not None and torch.equal(kept, fresh)
        assert torch.equal(layer(x), fresh) and layer._dense is first  # not made again
    finally:
        hold_dense(model, False, dtype)
    assert _held(model) == 0


def test_the_engine_keeps_them_while_a_prompt_prefills_only(packed, monkeypatch) -> None:
    ids = packed.tokenizer("The harbour master counted the boats. " * 40).input_ids
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = make_engine(packed.model, num_blocks=128, prefill_chunk=GEMM_ROWS * 2)
    seq = engine.add(Controller(ids), params)
    engine.step()  # the prompt's first piece
    assert engine.dense_bytes > 0 and _held(packed.model) > 0
    while seq.prefilled < len(ids):
        assert engine.dense_bytes > 0  # still a piece to go
        engine.step()
    assert engine.dense_bytes == 0 and _held(packed.model) == 0  # dropped with the last piece
    for _ in engine.run(seq):
        pass
    # an aborted prompt drops them too
    fresh = packed.tokenizer("A lighthouse keeper named her cat. " * 40).input_ids
    other = engine.add(Controller(fresh), params)  # no cached prefix
    engine.step()
    assert _held(packed.model) > 0
    engine.abort(other)
    assert engine.dense_bytes == 0 and _held(packed.model) == 0
    # the same tokens where every call dequantises its weight
    monkeypatch.setattr(engine_module, "hold_dense", lambda *_a: 0)
    again = run_one(make_engine(packed.model, num_blocks=128, prefill_chunk=GEMM_ROWS * 2),
                    ids, params)
    assert again.output_ids == seq.output_ids
