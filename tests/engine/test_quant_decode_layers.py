"""The ``stack`` decode route (a GGUF model's decode step in one native call) equals the
module path bit for bit, and a decode step it cannot take is named and counted.

``GGUFDecodeLayers`` re-does what the modules do without the module tree; an op left out
(a bias, a q/k norm, a sandwich norm), one taken in another dtype, a rotation with the
wrong table (a sliding layer's), a layer given another layer's keys, or a new row stored
in another sequence's block changes the logits or the pools. So each family's tiny model,
its projections in GGUF blocks, decodes under a DA view both ways with the same reads
recorded, one sequence and several at once.
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
from declattn.engine.models.decoder import DecodeRoute
from declattn.engine.models.layers import MLP, Attention, RMSNorm
from declattn.engine.paged import PagedAttention, SeqStep
from declattn.engine.quant import kernel, linear
from declattn.engine.quant.decode_layers import GGUFDecodeLayers
from declattn.engine.quant.fuse import fuse_gguf_projections
from declattn.engine.quant.kernel import decode_layer_ops
from declattn.engine.quant.linear import GGUFLinear
from declattn.engine.route import choose_route
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
    route = choose_route(model)
    assert route.kind == "stack" and isinstance(route.runner, GGUFDecodeLayers), route.why
    return model


class _CountedStack:
    """A runner's ``DecodeStack`` with its calls counted."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def run(self, *args):
        self.calls += 1
        return self.stack.run(*args)


class Narrow(Controller):
    def view(self, length):
        return sorted({1, (length - 1) // 16})


def _decode(model: Decoder, way: str, prompts: list[list[int]], controller=Narrow,
            max_tokens: int = 5):
    """Greedy decoding of ``prompts`` together on ``way`` (``stack``: the route
    ``choose_route`` gives; ``modules``: none): tokens, reads, final pools, stack calls,
    and the route (its ``missed`` counts)."""
    route = choose_route(model)
    counted = route.runner._stack = _CountedStack(route.runner._stack)
    model.use_route(route if way == "stack" else DecodeRoute())
    engine = PagedEngine(model, Tok(), num_blocks=48, block_size=16, prefill_chunk=64)
    seqs = [engine.add(controller(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    while engine.has_work:
        engine.step()
    reads = [[(r.blocks, r.global_bytes, r.sliding_bytes) for r in s.reads] for s in seqs]
    pools = [p.clone() for p in engine.cache.k + engine.cache.v]
    return [s.output_ids for s in seqs], reads, pools, counted.calls, route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_stack_equals_the_modules_bit_for_bit(family, dtype):
    """A pure decode step through ``DecodeStack`` stores the same keys and values, picks
    the same tokens and records the same reads as the modules, bit for bit; gemma3 has
    sliding layers. Every decode step after the prefill's first token takes the stack."""
    model = gguf_model(family, dtype)
    tokens = ids(70, 3)
    stack, modules = _decode(model, "stack", [tokens]), _decode(model, "modules", [tokens])
    assert stack[3] == 4 and modules[3] == 0 and not stack[4].missed
    assert stack[0] == modules[0] and stack[1] == modules[1]
    assert all(torch.equal(a, b) for a, b in zip(stack[2], modules[2], strict=True))
    assert stack[1][0][-1][0] == (1, (len(tokens) + 4 - 1) // 16)


def test_a_batch_of_sequences_takes_the_stack():
    """Three sequences decoding together store their new rows in three blocks apart: the
    stack stores each where the modules would and gives each the modules' tokens."""
    model = gguf_model("qwen2", torch.bfloat16)
    prompts = [ids(40, 5), ids(21, 6), ids(55, 7)]
    stack, modules = _decode(model, "stack", prompts), _decode(model, "modules", prompts)
    assert stack[3] >= 4 and not stack[4].missed
    assert stack[0] == modules[0] and stack[1] == modules[1]
    assert all(torch.equal(a, b) for a, b in zip(stack[2], modules[2], strict=True))


class Selecting(Narrow):
    """A query-aware controller: it picks each layer's blocks once the query exists."""

    selects_blocks = True

    def select_blocks(self, layer, q):
        return None  # its view, but the engine cannot know that before the query


def test_a_decode_step_whose_reads_cannot_be_planned_runs_layer_by_layer_and_is_counted():
    """Query-aware selection: the same native ops layer by layer around the attention
    function, bit for bit the modules' tokens, reads and pools."""
    model = gguf_model("qwen2", torch.bfloat16)
    tokens = ids(50, 4)
    stack = _decode(model, "stack", [tokens], Selecting)
    modules = _decode(model, "modules", [tokens], Selecting)
    assert stack[3] == 0 and stack[0] == modules[0] and stack[1] == modules[1]
    assert all(torch.equal(a, b) for a, b in zip(stack[2], modules[2], strict=True))
    reason = "query-aware selection (a layer's blocks depend on its query): layer by layer"
    assert stack[4].missed == {reason: 4}
    assert f"4 x {reason}" in stack[4].describe()


def test_the_runner_counts_what_it_does_not_compute_as_the_modules_do(monkeypatch):
    """Not a decode step on paged KV (dense attention, a prefill): ``None``, the modules'
    work, not counted. A decode step the native ops would not compute as the modules do:
    ``None``, counted with its reason."""
    model = gguf_model("qwen2", torch.bfloat16)
    runner = model.decode_route.runner
    c = model.config
    cache = PagedEngine(model, Tok(), num_blocks=8, block_size=16).cache
    cache.allocate(0, 20)
    h = torch.randn(1, c.hidden_size, dtype=torch.bfloat16)
    rope = model._rotary_global.cos_sin(torch.tensor([19]))
    step = [SeqStep(0, 19, 1, None)]
    with torch.inference_mode():
        assert runner(h, rope, rope, DenseAttention()) is None
        prefill = torch.randn(19, c.hidden_size, dtype=torch.bfloat16)
        assert runner(prefill, rope, rope, PagedAttention(cache, [SeqStep(0, 0, 19)])) is None
        assert not runner.missed
        assert isinstance(runner(h, rope, rope, PagedAttention(cache, step)), torch.Tensor)
        assert runner(h.float(), rope, rope, PagedAttention(cache, step)) is None
        monkeypatch.setattr(linear, "GEMM_ROWS", 1)  # GGUFLinear reads it per call too
        assert runner(h, rope, rope, PagedAttention(cache, step)) is None
        monkeypatch.undo()
        torch_kernel = PagedAttention(cache, step, kernel="torch")
        assert isinstance(runner(h, rope, rope, torch_kernel), torch.Tensor)
    assert runner(h, rope, rope, PagedAttention(cache, step)) is None
    assert runner.missed == {
        "activations in torch.float32, the model in torch.bfloat16: the modules ran it": 1,
        "1 rows (from 1, GGUF layers take the GEMM way): the modules ran it": 1,
        "decode attention on the torch kernel: layer by layer": 1,
        "gradients enabled (the native ops have no backward): the modules ran it": 1,
    }


def test_a_model_not_all_gguf_runs_the_modules_and_says_why():
    model = gguf_model("llama", torch.float32)
    model.layers[1].mlp.down_proj = torch.nn.Linear(128, 64)
    route = choose_route(model)
    assert route.kind == "modules" and route.runner is None
    assert route.why == "layer 1's down_proj is Linear, not GGUF blocks"
    dense = Decoder(model.config)
    assert choose_route(dense).why == "dense weights (the stack takes GGUF blocks)"


def test_a_layer_whose_norms_differ_in_form_runs_the_modules():
    """The layer ops take one eps and one form per layer (as every family builds its
    norms); a layer that breaks that runs the modules rather than a wrong norm."""
    model = gguf_model("qwen2", torch.bfloat16)
    model.layers[1].mlp_norm.eps = model.layers[1].attn_norm.eps * 10
    route = choose_route(model)
    assert route.kind == "modules" and route.why == "layer 1's norms differ in eps or form"


def test_a_kernel_switched_off_runs_the_modules_and_says_which(monkeypatch):
    from declattn.engine.models import fused

    model = gguf_model("qwen2", torch.bfloat16)
    cached = (kernel.decode_layer_ops, fused.layer_ops)
    monkeypatch.setenv(fused.ENV_SWITCH, "torch")
    for f in cached:
        f.cache_clear()
    try:
        route = choose_route(model)
    finally:
        monkeypatch.undo()
        for f in cached:
            f.cache_clear()
    assert route.kind == "modules" and "DECLATTN_LAYER_KERNEL=torch" in route.why
    assert choose_route(model).kind == "stack"


def test_the_stack_names_a_wrong_number_of_layers():
    model = gguf_model("qwen2", torch.bfloat16)
    stack = model.decode_route.runner._stack
    h = torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = model._rotary_global.cos_sin(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="one pool pair and one run batch per layer"):
        stack.run(h, cos, sin, cos, sin, [], [], torch.zeros(1, dtype=torch.int64), [], [], 256)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "inter"), [(1, 4864), (3, 4864), (7, 4864), (8, 4864),
                                             (7, 4800), (9, 96)])
def test_the_gated_activation_equals_atens_at_every_batch_and_width(rows, inter, threads):
    """``after_attention``'s silu(gate) * up, fused over the batch's rows where ATen's own
    would take its vector path for every element, equals the modules' ATen ops bit for
    bit at qwen2.5-0.5b's width (7 x 4864 and 8 x 4864 elements split among threads by
    ATen), where ATen's split would cut a row off its vector path (7 x 4800 on 2 threads:
    the fused loop steps aside) and at a width not a multiple of 64."""
    hidden = 64
    gen = torch.Generator().manual_seed(rows * 1000 + inter)

    def gguf(out_f: int, in_f: int) -> GGUFLinear:
        linear = torch.nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out_f, in_f, generator=gen) / in_f**0.5)
        return _as_gguf(linear, Q.Q8_0)

    o, gate_up, down = gguf(hidden, hidden), gguf(2 * inter, hidden), gguf(hidden, inter)
    mlp_norm = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
    h = torch.randn(rows, hidden, generator=gen).bfloat16()
    out = torch.randn(rows, 4, hidden // 4, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_layer_ops().after_attention(
            h, out, 1e-6, False, [o.blocks], [o.kernel_type], None, None,
            mlp_norm.weight.detach(),
            [gate_up.blocks], [gate_up.kernel_type], None, "silu", [down.blocks],
            [down.kernel_type], None, None,
        )
        x = o(out.reshape(rows, hidden)) + h
        gate, up = gate_up(mlp_norm(x)).chunk(2, dim=-1)
        want = down(torch.nn.functional.silu(gate) * up) + x
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
