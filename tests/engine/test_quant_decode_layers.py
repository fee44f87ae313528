"""The flat run of a GGUF model's layers for short steps equals the module path bit for bit.

``GGUFDecodeLayers`` re-does what the modules do without the module tree; an op left out
(a bias, a q/k norm, a sandwich norm), one taken in another dtype, a rotation with the
wrong table (a sliding layer's), or a layer given another layer's keys changes the logits.
So each family's tiny model, its projections in GGUF blocks, runs both ways, and the
engine decodes under a DA view both ways with the same reads recorded.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_models import _randomise, _tiny_hf
from tiny_world import Tok, prompt

from declattn.engine.controller import Controller
from declattn.engine.dense import DenseAttention
from declattn.engine.engine import PagedEngine
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.models.layers import MLP, Attention
from declattn.engine.paged import PagedAttention
from declattn.engine.quant import kernel, linear
from declattn.engine.quant.decode_layers import GGUFDecodeLayers
from declattn.engine.quant.fuse import fuse_gguf_projections
from declattn.engine.quant.linear import GEMM_ROWS, GGUFLinear
from declattn.engine.sampler import SamplingParams

Q = GGMLQuantizationType
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]  # plain; q/k/v bias; q/k norms; sandwich + windows


@pytest.fixture(scope="module", autouse=True)
def ops():
    if kernel.gguf_ops() is None:
        pytest.skip("the GGUF kernel is not available")


def ids(n: int, seed: int) -> list[int]:
    return [i % 256 for i in prompt(n, seed)]  # test_models' vocabulary


def _as_gguf(linear: torch.nn.Linear, kind: Q) -> GGUFLinear:
    w = linear.weight.detach().float().numpy()
    layer = GGUFLinear(torch.from_numpy(quantize(w, kind).copy()), int(kind), w.shape[1])
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer


def gguf_model(family: str, dtype: torch.dtype) -> Decoder:
    """A tiny ``family`` model with random weights, every projection in GGUF blocks (Q8_0,
    the MLP's gate Q5_0: regrouped), merged and given its runner as the loader does."""
    model = Decoder(ModelConfig.from_hf(_tiny_hf(family).config.to_dict()))
    _randomise(model, gemma=family == "gemma3")
    model = model.to(dtype).eval()
    for m in list(model.modules()):
        if isinstance(m, Attention):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(m, name, _as_gguf(getattr(m, name), Q.Q8_0))
        elif isinstance(m, MLP):
            m.gate_proj = _as_gguf(m.gate_proj, Q.Q5_0)
            m.up_proj, m.down_proj = _as_gguf(m.up_proj, Q.Q8_0), _as_gguf(m.down_proj, Q.Q8_0)
    fuse_gguf_projections(model)
    assert isinstance(model.layer_runner, GGUFDecodeLayers)
    return model


def _logits_both_ways(model: Decoder, tokens: list[int], decode: int) -> list[tuple]:
    """A prefill of ``tokens`` then ``decode`` one-token steps, with and without the runner
    (each its own KV), the logits of every step side by side."""
    runner = model.layer_runner
    taken: list[bool] = []

    def counted(*args):
        done = runner(*args)
        taken.append(done is not None)
        return done

    out = []
    kv = {True: DenseAttention(), False: DenseAttention()}
    with torch.inference_mode():
        feed, start = torch.tensor(tokens), 0
        for _ in range(decode + 1):
            pos = torch.arange(start, start + len(feed))
            step = {}
            for use in (True, False):
                model.use_layer_runner(counted if use else None)
                step[use] = model.logits(model(feed, pos, kv[use]))
            out.append((step[True], step[False]))
            start += len(feed)
            feed = step[False][-1:].argmax(-1)
    model.use_layer_runner(runner)
    assert taken == [True] * (decode + 1), "the runner did not take every step"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_runner_equals_the_modules_bit_for_bit(family, dtype):
    model = gguf_model(family, dtype)
    steps = _logits_both_ways(model, ids(12, 1), decode=4)  # 12 < GEMM_ROWS: runner too
    assert steps[0][0].std() > 0.1, "logits too flat for equality to mean anything"
    for got, want in steps:
        assert torch.equal(got, want)


def test_runner_declines_what_it_does_not_compute_as_the_modules_do(monkeypatch):
    model = gguf_model("qwen2", torch.bfloat16)
    runner = model.layer_runner
    c = model.config
    h = torch.randn(1, c.hidden_size, dtype=torch.bfloat16)
    rope = model._rotary_global.cos_sin(torch.tensor([0]))
    with torch.inference_mode():
        assert runner(h, rope, rope, DenseAttention()) is not None
        long = torch.randn(GEMM_ROWS, c.hidden_size, dtype=torch.bfloat16)
        assert runner(long, rope, rope, DenseAttention()) is None  # the GEMM way
        assert runner(h.float(), rope, rope, DenseAttention()) is None  # another dtype
        monkeypatch.setattr(linear, "GEMM_ROWS", 1)  # GGUFLinear reads it per call too
        assert runner(h, rope, rope, DenseAttention()) is None
        monkeypatch.undo()
    assert runner(h, rope, rope, DenseAttention()) is None  # a gradient could be wanted


def test_a_model_not_all_gguf_gets_no_runner():
    model = gguf_model("llama", torch.float32)
    model.layers[1].mlp.down_proj = torch.nn.Linear(128, 64)
    assert GGUFDecodeLayers.of(model) is None
    fuse_gguf_projections(model)  # merging again sets the runner afresh: none here
    assert model.layer_runner is None


def test_a_layer_whose_norms_differ_in_form_gets_no_runner():
    """The layer ops take one eps and one form per layer (as every family builds its
    norms); a layer that breaks that runs the modules rather than a wrong norm."""
    model = gguf_model("qwen2", torch.bfloat16)
    assert GGUFDecodeLayers.of(model) is not None
    model.layers[1].mlp_norm.eps = model.layers[1].attn_norm.eps * 10
    assert GGUFDecodeLayers.of(model) is None


def test_engine_decodes_a_view_alike_both_ways_and_counts_the_same_reads():
    """The paged path: keys written to the pool, a DA view planned into runs, the counter
    fed; greedy tokens, each step's blocks and bytes equal with and without the runner."""
    model = gguf_model("qwen2", torch.bfloat16)
    tokens = ids(100, 2)

    class Narrow(Controller):
        def view(self, length):
            return sorted({0, 2, (length - 1) // 16})

    def run(use: bool):
        model.use_layer_runner(GGUFDecodeLayers.of(model) if use else None)
        engine = PagedEngine(model, Tok(), num_blocks=64, block_size=16, prefill_chunk=64)
        seq = engine.add(Narrow(tokens), SamplingParams(max_tokens=6, ignore_eos=True))
        for _ in engine.run(seq):
            pass
        return seq

    fast, slow = run(True), run(False)
    assert fast.output_ids == slow.output_ids
    assert [(r.blocks, r.global_bytes) for r in fast.reads] == [
        (r.blocks, r.global_bytes) for r in slow.reads
    ]
    assert fast.reads[-1].blocks == (0, 2, 6)


class _CountedStack:
    """The runner's ``DecodeStack`` with its calls counted."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def run(self, *args):
        self.calls += 1
        return self.stack.run(*args)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_per_step_equals_layer_by_layer_and_the_modules(family, monkeypatch):
    """A pure decode step through ``DecodeStack`` (one native call for every layer) stores
    the same keys and values, picks the same tokens and records the same reads as the
    runner layer by layer and as the modules, bit for bit; gemma3 has sliding layers."""
    model = gguf_model(family, torch.bfloat16)
    tokens = ids(70, 3)

    class Narrow(Controller):
        def view(self, length):
            return sorted({1, (length - 1) // 16})

    def run(way: str):
        runner = GGUFDecodeLayers.of(model)
        counted = _CountedStack(runner._stack)
        runner._stack = counted
        model.use_layer_runner(None if way == "modules" else runner)
        with monkeypatch.context() as m:
            if way == "layers":
                m.setattr(PagedAttention, "decode_reads", lambda self, windows: None)
            engine = PagedEngine(model, Tok(), num_blocks=32, block_size=16, prefill_chunk=64)
            seq = engine.add(Narrow(tokens), SamplingParams(max_tokens=5, ignore_eos=True))
            for _ in engine.run(seq):
                pass
        reads = [(r.blocks, r.global_bytes, r.sliding_bytes) for r in seq.reads]
        pools = [p.clone() for p in engine.cache.k + engine.cache.v]
        return seq.output_ids, reads, pools, counted.calls

    stack, layers, modules = run("stack"), run("layers"), run("modules")
    assert stack[3] == 4 and layers[3] == 0  # the 4 steps after the prefill's first token
    for other in (layers, modules):
        assert stack[0] == other[0] and stack[1] == other[1]
        assert all(torch.equal(a, b) for a, b in zip(stack[2], other[2], strict=True))
    assert stack[1][-1][0] == (1, (len(tokens) + 4 - 1) // 16)


def test_the_stack_names_a_wrong_number_of_layers():
    model = gguf_model("qwen2", torch.bfloat16)
    stack = model.layer_runner._stack
    h = torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = model._rotary_global.cos_sin(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="one pool pair and one run batch per layer"):
        stack.run(h, cos, sin, cos, sin, [], [], 0, [], [], 256)
