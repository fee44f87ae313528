"""Packed weights against dense ones on a shipped model, and the engine's parity rules
(paged == dense recompute, reads == scope) on packed weights.

The reference is the GGUF dequantised to fp32 (exactly what the file says). bf16 dense
weights are today's other path; the packed path (the file's own blocks, activations
rounded to int8 per block as llama.cpp does) may cost a few times bf16's error, not more.
The accuracy test prints its table (``pytest -s``); ``declattn bench weights`` gives it
for any shipped GGUF (docs/benchmarks.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from gguf_samples import gguf_header
from harbour import CONTEXT, QUESTION, TRANSCRIPT
from test_engine import dense_greedy, make_engine, prompt, run_one, tiny_model
from torch import Tensor

from declattn.api import Engine
from declattn.bench.quant_accuracy import PROMPTS, markdown, measure
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.engine.controller import Controller, Forced
from declattn.engine.dense import DenseAttention
from declattn.engine.loader import load_model
from declattn.engine.quant import GGUFLinear, QuantLinear, linear
from declattn.engine.quant.dense import pack_dense
from declattn.engine.registry import resolve_model
from declattn.engine.sampler import SamplingParams
from declattn.protocol.modes import Mode

STEPS = 16


@pytest.fixture(scope="module")
def accuracy():
    result = measure("smollm2-135m", PROMPTS[:6], STEPS)
    print("\n" + markdown(result))
    return result


@pytest.fixture(scope="module")
def packed():
    """SmolLM2's default load, packed from the GGUF's blocks (``Engine.from_pretrained``'s
    on a CPU): loaded once for the tests that only read it."""
    return load_model(resolve_model("smollm2-135m"), device="cpu")


def _elements_in_file(path) -> int:
    """Elements of every tensor the GGUF's own tensor table lists (``gguf_header``)."""
    return sum(math.prod(shape) for _, shape, *_ in gguf_header(path)[2])


def test_the_default_load_of_a_gguf_is_packed_from_its_blocks(packed):
    assert packed.quant is not None and packed.quant.layers == {"Q4_1->gguf": 210, "Q8_0->gguf": 1}
    layers = [m for m in packed.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 211 and all(isinstance(m, GGUFLinear) for m in layers)
    in_file = _elements_in_file(resolve_model("smollm2-135m"))
    assert in_file > 100_000_000 and packed.model.parameter_count() == in_file


def test_packed_logits_and_greedy_tokens_track_the_file(accuracy):
    """A few times bf16's error at most, on both paths (see ``bench/quant_accuracy``)."""
    n, arms = accuracy["positions"], accuracy["arms"]
    assert accuracy["bytes_per_step"]["packed"] < 0.4 * accuracy["bytes_per_step"]["bf16"]
    for name in ("packed decode", "packed prefill"):
        assert arms[name]["agree"] >= 0.95 * n, name
        assert arms[name]["mean_abs"] < 3 * arms["bf16"]["mean_abs"], name
        assert arms[name]["max_abs"] < 3.0, name
    # the file's weights exactly in an fp32 GEMM: what is left is bf16 activations' rounding
    assert arms["packed prefill"]["mean_abs"] < 1.5 * arms["bf16"]["mean_abs"]


def _paged_and_dense_logits(loaded, ids: list[int], n: int) -> tuple[list[int], Tensor, Tensor]:
    """The engine's greedy tokens for ``ids`` and its logits at each, and a dense
    recompute's logits teacher-forced on those tokens (``[n, vocab]`` each)."""
    engine = Engine(loaded, kv_tokens=1024)
    seen: list[Tensor] = []

    class Recorder(Controller):
        def process_logits(self, logits: Tensor) -> Tensor:
            seen.append(logits.clone())
            return logits

    seq = engine.add(Recorder(ids), SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in engine.run(seq):
        pass
    full = torch.tensor(ids + seq.output_ids[:-1])
    with torch.no_grad():
        hidden = loaded.model(full, torch.arange(full.numel()), DenseAttention())
        dense = loaded.model.logits(hidden[len(ids) - 1 :])
    return seq.output_ids, torch.stack(seen), dense


def test_paged_equals_dense_recompute_on_packed_weights(monkeypatch, accuracy):
    """The engine's own rule, on the GGUF kernel's layers (fp32 activations, so that the
    attention paths are the only difference).

    Where the layers run the file's weights in an fp32 GEMM (``GEMM_ROWS`` 1: every step
    takes it) greedy tokens are equal. The decode kernel rounds activations to int8 per
    block of 32, as llama.cpp does: a step function, so the last-bit differences
    between paged and dense attention flip a few roundings and grow to that rounding's
    own noise (on the AMX Xeon guest, 2026-12-02: mean 0.17, max 1.2 teacher-forced,
    and one greedy token of 16 changed at a 0.4 margin). There the rule is the accuracy
    test's: no further from dense than the packed path is from the file."""
    loaded = load_model(resolve_model("smollm2-135m"), dtype=torch.float32, quantize=True)
    assert loaded.quant is not None
    bound = 3 * accuracy["arms"]["bf16"]["mean_abs"]
    prompts = [loaded.tokenizer(text * 6).input_ids for text in PROMPTS[:3]]  # a few blocks
    for ids in prompts:
        _, paged, dense = _paged_and_dense_logits(loaded, ids, 16)
        assert (paged.argmax(-1) == dense.argmax(-1)).sum() >= 14
        assert float((paged - dense).abs().mean()) < bound
        assert float((paged - dense).abs().max()) < 3.0
    monkeypatch.setattr(linear, "GEMM_ROWS", 1)
    for ids in prompts:
        tokens, paged, dense = _paged_and_dense_logits(loaded, ids, 16)
        assert tokens == dense.argmax(-1).tolist()
        assert float((paged - dense).abs().max()) < 1e-3


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_paged_equals_dense_on_torch_packed_layers(kind):
    model = pack_dense(tiny_model(), kind, torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 2 * 7 + 1
    ids = prompt(150, 1)
    seq = run_one(make_engine(model), ids, SamplingParams(max_tokens=24, ignore_eos=True))
    assert seq.output_ids == dense_greedy(model, ids, 24)


def test_reads_equal_the_scope_on_packed_weights(packed):
    """DA's accounting does not depend on how weights are stored: on the packed SmolLM2,
    every decode step reads exactly the scope's blocks, and live counts equal replay."""
    engine = Engine(packed, kv_tokens=4096)
    assert engine.loaded.quant is not None
    options = DAOptions(target=96, cap=128, min_context=0)
    sess = engine.session(CONTEXT, QUESTION, da=True, options=options)
    tokens = engine.tokenizer.encode(TRANSCRIPT, add_special_tokens=False)
    seq = engine.add(Forced(sess, tokens), SamplingParams(max_tokens=len(tokens), ignore_eos=True))
    for _ in engine.run(seq):
        pass
    assert len(seq.reads) == len(sess.expected_views) == len(seq.output_ids) - 1
    for read, expected in zip(seq.reads, sess.expected_views, strict=True):
        assert read.blocks == expected and read.layers_agree
    assert {Mode.GLOBAL, Mode.FOCUS, Mode.LOCAL} <= {s.mode for s in sess.steps}
    rep = replay(sess.layout, seq.token_texts, block_size=engine.block_size)
    assert rep.totals() == sess.accounting.totals()
