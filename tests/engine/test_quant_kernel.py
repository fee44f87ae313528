"""The GGUF matmul kernel multiplies by a file's blocks as gguf-py dequantises them.

Its activations are rounded to int8 per block, as llama.cpp's are, so it matches the
dequantised matmul to that rounding (well under 2% of the output's norm); a block read
in the wrong order or with the wrong scale is off by the size of the output itself.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from gguf_samples import gguf_blocks

from declattn.engine import native
from declattn.engine.quant import kernel
from declattn.engine.quant.linear import GEMM_ROWS, GGUFLinear, bf16_gemm

Q = GGMLQuantizationType
NATIVE = [Q(t) for t in sorted(kernel.NATIVE_TYPES)]


@pytest.fixture(scope="module")
def op():
    found = kernel.gguf_ops()
    if found is None:
        if os.environ.get(kernel.ENV_SWITCH) == "torch":
            pytest.skip(f"{kernel.ENV_SWITCH}=torch")
        pytest.fail("the GGUF kernel did not build (see the warning)")
    return found.gguf_linear


def _case(kind: Q, rows: int = 50, cols: int = 512, seed: int = 0):
    raw = gguf_blocks(kind, rows, cols, np.random.default_rng(seed + int(kind)))
    w = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols)).double()
    return torch.from_numpy(raw.copy()), w


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", NATIVE, ids=lambda k: k.name)
@pytest.mark.parametrize("m", [1, 37])  # a decode row; a prefill chunk
@pytest.mark.parametrize("cols", [512, 864])  # 864: 27 blocks of 32, 3 super-blocks of 256
def test_kernel_matches_the_dequantised_matmul(op, kind, m, cols):
    """Rows not a multiple of 4 or 16, blocks not a multiple of 8: every tail is taken."""
    if cols % GGML_QUANT_SIZES[kind][0]:
        cols = cols // 256 * 256
    blocks, w = _case(kind, rows=50, cols=cols)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.t()
    assert _rel(op(x, blocks, int(kind)), ref) < 0.02
    y16 = op(x.bfloat16(), blocks, int(kind))
    assert y16.dtype == torch.bfloat16 and _rel(y16, ref) < 0.02


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's rounding of activations, in torch: per block of 32 the scale
    max |x| / 127, the codes x / scale rounded half to even (as ``nearbyint``)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("plain", [False, True], ids=["vector", "plain"])
def test_activation_rounding_is_llama_cpps_on_both_paths(op, dtype, plain):
    """The vector rounding (AVX2) and the plain loop give torch's numbers bit for bit,
    ties (a code of exactly k + 1/2) and an all-zero block included."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4864, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    x[0, :32] = 0.0
    x[1, :32] = torch.arange(32) - 15.5  # halves; with 127 the scale is 1, so codes tie
    x[1, 0] = 127.0
    x = x.to(dtype)
    q, d = torch.ops.declattn.gguf_quantize(x, plain)
    ref_q, ref_d = _rounded(x)
    assert torch.equal(d, ref_d) and torch.equal(q, ref_q)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU")
def test_kernels_run_on_the_threads_torch_is_given(op):
    """Built without OpenMP, torch's ``at::parallel_for`` runs on one thread whatever
    ``torch.set_num_threads`` says (both native kernels did, until this test)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.declattn.threads_used(64) == 2
        torch.set_num_threads(1)
        assert torch.ops.declattn.threads_used(64) == 1
    finally:
        torch.set_num_threads(before)


def test_kernel_is_the_same_on_one_and_two_threads(op):
    blocks, w = _case(Q.Q6_K, rows=96)
    x = torch.randn(3, w.shape[1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = op(x, blocks, int(Q.Q6_K))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(op(x, blocks, int(Q.Q6_K)), two)


@pytest.mark.parametrize("kind", NATIVE, ids=lambda k: k.name)
def test_layer_dequantises_to_the_file_weight_and_keeps_its_bytes(op, kind):
    blocks, w = _case(kind)
    layer = GGUFLinear(blocks, int(kind), w.shape[1])
    # gguf-py's arithmetic, to one fp32 rounding (the kernel may fuse a multiply-add)
    torch.testing.assert_close(layer.dequantized().double(), w, rtol=1e-6, atol=1e-7)
    # a bf16 prefill's weight: the fp32 one rounded by torch, bit for bit, in every layout
    assert torch.equal(layer.gemm_weight(torch.bfloat16).view(torch.int16),
                       layer.dequantized().to(torch.bfloat16).view(torch.int16))
    assert layer.weight_bytes == blocks.numel()  # the file's bits per weight
    few = torch.randn(2, 3, w.shape[1])
    assert layer(few).shape == (2, 3, w.shape[0])
    many = torch.randn(GEMM_ROWS, w.shape[1])  # a prefill chunk: the fp32 GEMM path
    ref = many.double() @ w.t()
    assert _rel(layer(many), ref) < 1e-5 < _rel(op(many, blocks, int(kind)), ref)


@pytest.mark.parametrize("kind", [Q.Q5_0, Q.Q4_K], ids=lambda k: k.name)
def test_a_bf16_prefill_chunk_takes_the_bf16_gemm_only_where_the_cpu_computes_bf16(op, kind):
    """bf16 activations of a prefill chunk: the weight rounded to bf16 and a bf16 GEMM
    where oneDNN has native bf16 kernels (``bf16_gemm``), else the fp32 GEMM; either
    way close to the exact product."""
    blocks, w = _case(kind)
    layer = GGUFLinear(blocks, int(kind), w.shape[1])
    x = torch.randn(GEMM_ROWS + 3, w.shape[1]).bfloat16()
    got = layer(x)
    exact = layer.dequantized()
    if bf16_gemm():
        want = torch.nn.functional.linear(x, exact.bfloat16())
    else:
        want = torch.nn.functional.linear(x.float(), exact).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert _rel(got, x.double() @ w.t()) < 1e-2


REGROUPED = {8: {Q.Q5_0: 1006, Q.Q8_0: 1008}, 16: {Q.Q5_0: 2006, Q.Q8_0: 2008}}
"""The kernel's ids for a format regrouped by eight rows (gguf_q5_0_rows8.h,
gguf_q8_0_rows8.h; AVX2) and by sixteen (gguf_rows16_vnni.h; AVX-512 VNNI)."""


def _readable_groups() -> list[int]:
    """The regrouped layouts the loaded variant reads, best first."""
    lib = native.library()
    flags = set(lib.isa) if lib is not None else set()
    return [16] * ({"avx512_vnni", "avx512bw"} <= flags) + [8] * ("avx2" in flags)


def _best(kind: Q) -> int:
    """The layout ``gguf_repack`` picks here for a matrix of ``kind`` with whole groups."""
    groups = _readable_groups()
    return REGROUPED[groups[0]][kind] if groups else int(kind)


def _assert_same_as_the_files(op, ops, blocks, kind, packed, kernel_type, cols):
    """A regrouped matrix unpacks to the file's blocks, dequantizes to the same values and
    multiplies to the same outputs, bit for bit, for a few row counts and both dtypes."""
    assert torch.equal(ops.gguf_unpack(packed, kernel_type), blocks)
    assert torch.equal(ops.gguf_dequantize(packed, kernel_type, cols),
                       ops.gguf_dequantize(blocks, kind, cols))
    assert torch.equal(ops.gguf_dequantize(packed, kernel_type, cols, True).view(torch.int16),
                       ops.gguf_dequantize(blocks, kind, cols).to(torch.bfloat16).view(torch.int16))
    for m in (1, 3, 5, 17):  # 17 = 8 + 8 + 1 rows, 5 = 4 + 1, 3 = 2 + 1 in a batch
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(dtype)
            assert torch.equal(op(x, packed, kernel_type), op(x, blocks, kind)), (m, dtype)


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("kind", [Q.Q5_0, Q.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("rows,cols", [(50, 864), (8, 32), (16, 64), (96, 512), (7, 64)])
def test_regrouped_layout_gives_the_file_layouts_results_bit_for_bit(op, group, kind, rows, cols):
    """The regrouped layout is the same integer work in another order of bytes: any bit
    of a code, a high bit or a scale put in the wrong place changes the output. Rows past
    the last group (50 = 6 x 8 + 2 = 3 x 16 + 2) stay in the file's layout."""
    ops = kernel.gguf_ops()
    if group not in _readable_groups():
        with pytest.raises(RuntimeError, match=f"cannot read rows regrouped by {group}"):
            ops.gguf_repack(_case(kind, rows=rows, cols=cols)[0], int(kind), group)
        return
    blocks, w = _case(kind, rows=rows, cols=cols)
    packed, kernel_type = ops.gguf_repack(blocks, int(kind), group)
    if rows < group:
        assert kernel_type == int(kind) and torch.equal(packed, blocks)
        return
    assert kernel_type == REGROUPED[group][kind] and packed.shape == blocks.shape
    assert not torch.equal(packed, blocks)
    _assert_same_as_the_files(op, ops, blocks, int(kind), packed, kernel_type, cols)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K], ids=lambda k: k.name)
@pytest.mark.parametrize("rows,cols", [(50, 512), (16, 256), (96, 768), (7, 256)])
def test_k_formats_regrouped_by_sixteen_give_the_file_layouts_results_bit_for_bit(
    op, kind, rows, cols
):
    """Q4_K and Q6_K by sixteen rows (AVX-512 VNNI; ``gguf_k_rows16.h``) move every byte
    of the file's rows and sum each group's products in its own lanes: a misplaced code
    bit, high bit or scale changes the output, and the float work per row is the file
    kernel's in its order, so the outputs are equal, not close. Rows past the last group
    (50 = 3 x 16 + 2) stay in the file's layout; without VNNI the file's layout stays."""
    ops = kernel.gguf_ops()
    blocks, _ = _case(kind, rows=rows, cols=cols)
    packed, kernel_type = ops.gguf_repack(blocks, int(kind))
    if rows < 16 or 16 not in _readable_groups():
        assert kernel_type == int(kind) and torch.equal(packed, blocks)
        return
    assert kernel.REGROUPED[kernel_type] == (kind.name, 16)
    assert packed.shape == blocks.shape and not torch.equal(packed, blocks)
    _assert_same_as_the_files(op, ops, blocks, int(kind), packed, kernel_type, cols)
    layer = GGUFLinear(blocks, int(kind), cols)
    assert layer.kernel_type == kernel_type and torch.equal(layer.file_blocks(), blocks)


def test_repack_takes_the_best_layout_this_build_reads_or_the_files():
    ops = kernel.gguf_ops()
    for kind in (Q.Q5_0, Q.Q8_0):
        blocks, _ = _case(kind, rows=32, cols=64)
        assert ops.gguf_repack(blocks, int(kind))[1] == _best(kind)
        packed, kernel_type = ops.gguf_repack(blocks, int(kind), -1)
        assert kernel_type == int(kind) and torch.equal(packed, blocks)
    with pytest.raises(RuntimeError, match="rows 0 .best., -1 .the file's layout., 8 or 16"):
        ops.gguf_repack(blocks, int(Q.Q8_0), 4)


def test_q8_0_with_a_code_of_minus_128_is_right_in_every_layout(op):
    """The eight-row Q8_0 kernel signs the codes by x, which -128 does not survive: ggml
    never writes -128, but a matrix with one stays in the file's layout there. The
    sixteen-row kernel stores codes plus 128 as unsigned bytes, so -128 is a code like
    any other."""
    blocks, w = _case(Q.Q8_0, rows=32, cols=256)
    blocks[5, 34 * 3 + 2 + 7] = 0x80  # row 5, block 3, code 7
    w[5, 32 * 3 + 7] = -128 * float(blocks[5, 102:104].view(torch.float16))
    x = torch.zeros(1, 256)
    x[0, 32 * 3 + 7] = -1.0  # a negative x meets the -128
    ops = kernel.gguf_ops()
    for group in _readable_groups():
        packed, kernel_type = ops.gguf_repack(blocks, int(Q.Q8_0), group)
        if group == 8:
            assert kernel_type == int(Q.Q8_0) and torch.equal(packed, blocks)
        else:
            assert kernel_type == REGROUPED[16][Q.Q8_0]
            assert torch.equal(ops.gguf_unpack(packed, kernel_type), blocks)
        assert _rel(op(x, packed, kernel_type), x.double() @ w.t()) < 1e-3
    assert _rel(op(x, blocks, int(Q.Q8_0)), x.double() @ w.t()) < 1e-3


@pytest.mark.parametrize("kind", [Q.Q5_0, Q.Q8_0], ids=lambda k: k.name)
def test_a_layer_keeps_the_kernels_layout_and_gives_the_files_back(op, kind):
    blocks, w = _case(kind, rows=64)
    layer = GGUFLinear(blocks, int(kind), w.shape[1])
    plain = GGUFLinear(blocks, int(kind), w.shape[1], group_rows=-1)
    assert layer.ggml_type == plain.kernel_type == int(kind)
    assert layer.kernel_type == _best(kind)
    assert torch.equal(layer.file_blocks(), blocks) and torch.equal(plain.file_blocks(), blocks)
    assert layer.weight_bytes == plain.weight_bytes == blocks.numel()
    x = torch.randn(1, w.shape[1])
    assert torch.equal(layer(x), plain(x))
    assert torch.equal(layer.dequantized(), plain.dequantized())


def test_bias_is_added_on_both_paths(op):
    blocks, w = _case(Q.Q8_0)
    layer = GGUFLinear(blocks, int(Q.Q8_0), w.shape[1])
    layer.bias = torch.nn.Parameter(torch.randn(w.shape[0]), requires_grad=False)
    for rows in (1, GEMM_ROWS):
        x = torch.randn(rows, w.shape[1])
        ref = x.double() @ w.t() + layer.bias.double()
        assert _rel(layer(x), ref) < 0.02, rows


def test_wrong_inputs_are_refused(op):
    blocks, _ = _case(Q.Q8_0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        op(torch.randn(1, 512), blocks, int(Q.Q5_1))
    with pytest.raises(RuntimeError, match="do not match"):
        op(torch.randn(1, 480), blocks, int(Q.Q8_0))


@pytest.mark.slow
def test_portable_build_agrees_with_the_vector_build(op, tmp_path):
    """The plain C++ path (no AVX2, no F16C) is what other CPUs run: built here for the
    compiler's default target, into a namespace of its own, it must give what the loaded
    variant gives, to float rounding."""
    from torch.utils import cpp_extension

    from declattn.engine.native.variants import CSRC

    lib = tmp_path / "portable.so"
    cmd = ["g++", "-O2", "-std=c++17", "-fPIC", "-shared", "-DDECLATTN_OP_NAMESPACE=dq_test",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    cmd += [str(CSRC / "gguf_matmul.cpp"), "-o", str(lib)]
    for d in cpp_extension.library_paths():
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    subprocess.run([*cmd, "-lc10", "-ltorch_cpu"], check=True, capture_output=True)
    torch.ops.load_library(str(lib))
    for kind in NATIVE:
        blocks, w = _case(kind, rows=20)
        x = torch.randn(2, w.shape[1])
        fast, plain = op(x, blocks, int(kind)), torch.ops.dq_test.gguf_linear(x, blocks, int(kind))
        assert (fast - plain).abs().max() <= 1e-5 * fast.abs().max(), kind.name
