"""Weight-only quantized linear layers: GGUF blocks (our kernel) or torch's packed ones.

A decode step multiplies one row by every weight matrix of the model, so it is bound by
the bytes of weights it reads: 4-bit codes read a quarter of bf16's bytes, int8 half.
The kernels (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``) take
bf16/fp32 activations and return them in the same dtype, so the rest of the model is
untouched. Their conventions, checked in tests against a plain matmul:

- int4: ``w = (q - 8) * scale + zero`` per group of ``group`` columns, ``q`` in
  ``[0, 16)``; scale and zero ``[cols // group, rows, 2]`` in the activation dtype;
  rows a multiple of 16 (padded here), group 32, 64, 128 or 256.
- int8: ``w = q * scale`` per row, ``q`` int8, scale ``[rows]`` in the activation dtype;
  cols a multiple of 8 (narrower matrices stay dense: the kernel faults on them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from declattn.engine.memory import available_bytes

GEMM_ROWS = 32
"""From this many rows on, a GGUF layer multiplies through its dequantised weight (an fp32
GEMM, or bf16 where ``bf16_gemm``): many rows are bound by arithmetic, where a float GEMM
beats the integer kernel; the integer kernel wins where the bytes, not the arithmetic,
bound the time (decode)."""
INT4_GROUPS = (32, 64, 128, 256)
_INT4_ROW_MULTIPLE = 16
_INT8_COL_MULTIPLE = 8


@functools.cache
def bf16_gemm() -> bool:
    """Whether a prefill chunk's GEMM runs in bf16 (weights dequantised, then rounded to
    bf16, as a dense bf16 model holds them): only where the CPU computes bf16 natively
    (oneDNN's AVX-512 BF16 kernels), where a bf16 GEMM does several times the fp32 one's
    work per cycle; on an AVX2-only CPU bf16 is emulated and several times slower, so
    there the GEMM stays fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def aligned(t: Tensor) -> Tensor:
    """``t`` contiguous at a 64-byte boundary, copied only if it is not. Tensors loaded
    from the packed cache are views into its safetensors file at any offset, and
    torch's ``_weight_int8pack_mm`` can crash (segmentation fault) on codes and scales
    that are not (seen on AVX-512, 56 bytes past a boundary)."""
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation


class QuantLinear(nn.Module):
    """A linear layer ``y = x W^T + b`` whose ``W`` is stored packed.

    Packed tensors are buffers, not parameters: nothing trains them, and ``parameters()``
    keeps meaning the float tensors of the model. ``in_features``/``out_features`` are
    the logical shape; ``weight_bytes`` is what one multiplication reads.
    """

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def dequantized(self) -> Tensor:
        """The float32 ``[out, in]`` weight that this layer multiplies by (for tests)."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _finish(self, y: Tensor, shape: torch.Size) -> Tensor:
        if y.shape[-1] != self.out_features:
            y = y[..., : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GGUFLinear(QuantLinear):
    """The GGUF file's own blocks of one matrix, rows in the ``Decoder``'s order.

    A few rows (decode) go through ``gguf_linear``, activations rounded to int8 per block
    as llama.cpp does; many rows (a prefill chunk) through the dequantised weight and a
    float GEMM (bf16 for bf16 activations where the CPU computes bf16, else fp32), which
    is faster there (compute-bound, not byte-bound). The ops are
    looked up once, here: a decode step makes ~170 of these calls, and looking them up
    per call would add Python's cost to every one of them.

    ``blocks`` is held in the layout the kernel reads fastest (``gguf_repack``: Q5_0 and
    Q8_0 rows regrouped by sixteen with AVX-512 VNNI, by eight on AVX2, the same bytes;
    ``group_rows`` asks for one: 8 or 16, or -1 for the file's), and ``kernel_type``
    names it; ``ggml_type`` stays the file's format and ``file_blocks()`` gives the bytes
    back as the file holds them."""

    def __init__(
        self, blocks: Tensor, ggml_type: int, in_features: int, *, group_rows: int = 0
    ) -> None:
        super().__init__()
        from declattn.engine.quant.kernel import gguf_ops

        ops = gguf_ops()
        if ops is None:
            raise RuntimeError("the GGUF matmul kernel is not available (see the warning)")
        self._matmul, self._dequantize = ops.gguf_linear, ops.gguf_dequantize
        self._unpack = ops.gguf_unpack
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.ggml_type = ggml_type
        blocks = blocks.contiguous()
        blocks, self.kernel_type = ops.gguf_repack(blocks, ggml_type, group_rows)
        self.register_buffer("blocks", blocks)
        self.bias = None
        self.keep_dense = False
        """Keep the dequantised weight of a many-row call for the next (``hold_dense``)."""
        self._dense: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] < GEMM_ROWS:  # a decode step: the short way
            y = self._matmul(x.contiguous(), self.blocks, self.kernel_type)
            return y if self.bias is None else y + self.bias
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if x2.shape[0] >= GEMM_ROWS:
            if x2.dtype == torch.bfloat16 and bf16_gemm():
                y = F.linear(x2, self.gemm_weight(torch.bfloat16))
            else:
                y = F.linear(x2.float(), self.gemm_weight(torch.float32)).to(x.dtype)
        else:
            y = self._matmul(x2, self.blocks, self.kernel_type)
        return self._finish(y, shape)

    def gemm_weight(self, dtype: torch.dtype) -> Tensor:
        """The dequantised weight in ``dtype`` for a many-row GEMM: the one kept from the
        last such call while ``keep_dense`` is on, else made now (and kept if it is on)."""
        w = self._dense
        if w is None or w.dtype != dtype:
            bf16 = dtype == torch.bfloat16
            w = self._dequantize(self.blocks, self.kernel_type, self.in_features, bf16).to(dtype)
            self._dense = w if self.keep_dense else None
        return w

    def dequantized(self) -> Tensor:
        return self._dequantize(self.blocks, self.kernel_type, self.in_features)

    def file_blocks(self) -> Tensor:
        """The blocks in the GGUF file's layout (what the packed cache file stores)."""
        return self._unpack(self.blocks, self.kernel_type)


class GGUFConcat(nn.Module):
    """Several GGUF layers of one input as one layer, their outputs side by side: an
    attention's q/k/v, or an MLP's gate/up (``quant/fuse.py``).

    A decode row goes through all of them in one kernel call (``gguf_linear_cat``): the
    row is rounded to int8 once and the matrices' tiles are one range over the threads,
    so the small ones (qwen2.5-0.5b's 128-row k and v) no longer pay a call and a cold
    start each. Each part keeps its own format and layout, and every output is computed
    as the part alone computes it (bit for bit; tests). Prefill chunks go part by part.

    The parts stay where they are in the model (their weights, state-dict names and
    counts unchanged) and are only referred to here, not registered a second time."""

    def __init__(self, parts: list[GGUFLinear]) -> None:
        super().__init__()
        from declattn.engine.quant.kernel import gguf_ops

        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFConcat: one or more GGUF layers of the same input width")
        self._parts = list(parts)
        self._matmul = gguf_ops().gguf_linear_cat  # the parts exist, so the kernel does
        self._types = [p.kernel_type for p in parts]
        self._bias = _joined_bias(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def parts(self) -> tuple[GGUFLinear, ...]:
        return tuple(self._parts)

    @property
    def types(self) -> tuple[int, ...]:
        """Each part's ``kernel_type``, as the merged call takes them."""
        return tuple(self._types)

    @property
    def joined_bias(self) -> Tensor | None:
        """The parts' biases side by side (zeros for a part without one), or ``None``."""
        return self._bias

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] < GEMM_ROWS:
            y = self._matmul(x.contiguous(), [p.blocks for p in self._parts], self._types)
            return y if self._bias is None else y + self._bias
        return torch.cat([p(x) for p in self._parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _joined_bias(parts: list[GGUFLinear]) -> Tensor | None:
    """The parts' biases side by side (zeros for a part without one), or ``None``."""
    have = [p.bias for p in parts if p.bias is not None]
    if not have:
        return None
    return torch.cat([
        p.bias.detach() if p.bias is not None else have[0].new_zeros(p.out_features)
        for p in parts
    ])


class Int4Linear(QuantLinear):
    """4-bit codes, one scale and zero per group of columns (group-wise asymmetric)."""

    def __init__(
        self,
        packed: Tensor,
        scales_zeros: Tensor,
        in_features: int,
        out_features: int,
        group: int,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("packed", aligned(packed))
        self.register_buffer("scales_zeros", aligned(scales_zeros))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(
        cls,
        codes: Tensor,
        scale: Tensor,
        zero: Tensor,
        group: int,
        dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Int4Linear:
        """``codes`` ``[out, in]`` in ``[0, 16)``, ``scale``/``zero`` ``[out, in // group]``
        with ``w = (codes - 8) * scale + zero``."""
        out_features, in_features = codes.shape
        if group not in INT4_GROUPS or in_features % group:
            raise ValueError(f"int4: group {group} does not divide {in_features} columns")
        pad = -out_features % _INT4_ROW_MULTIPLE
        if pad:  # zero rows: their outputs are cut off in forward
            codes = torch.cat([codes, codes.new_full((pad, in_features), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, sz, in_features, out_features, group, bias)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group, self.scales_zeros
        )
        return self._finish(y, shape)

    def dequantized(self) -> Tensor:
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group, self.scales_zeros
        )
        return y[:, : self.out_features].t().float()


class Int8Linear(QuantLinear):
    """int8 codes with one scale per output row (per-channel symmetric)."""

    def __init__(self, codes: Tensor, scales: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", aligned(codes))
        self.register_buffer("scales", aligned(scales))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, w: Tensor, dtype: torch.dtype, bias: Tensor | None = None) -> Int8Linear:
        """Round ``w`` ``[out, in]`` to int8 with ``scale = max|row| / 127`` per row."""
        if w.shape[1] % _INT8_COL_MULTIPLE:
            raise ValueError(f"int8: {w.shape[1]} columns, not a multiple of 8")
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).to(dtype).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scale.to(dtype), bias)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.codes, self.scales)
        return self._finish(y, shape)

    def dequantized(self) -> Tensor:
        return self.codes.float() * self.scales.float()[:, None]


def int4_fits(out_features: int, in_features: int, group: int = 32) -> bool:
    """Whether the int4 kernel takes this shape (rows are padded, columns are not)."""
    del out_features
    return group in INT4_GROUPS and in_features % group == 0


def int8_fits(out_features: int, in_features: int) -> bool:
    del out_features
    return in_features % _INT8_COL_MULTIPLE == 0


def hold_dense(model: nn.Module, on: bool, dtype: torch.dtype) -> int:
    """Keep (``on``) or drop every GGUF layer's dequantised weight between many-row calls;
    the bytes it may hold (0 when off or refused).

    A prompt's prefill runs one many-row call per matrix per step, and each call
    dequantises its whole matrix: on CPU that costs about as much as the GEMM itself. While
    prompts prefill, the engine keeps the dense weights from one step to the next (bf16
    where the GEMM runs in bf16, else fp32), and drops them once no prompt is left, so
    decoding holds only the file's blocks. The numbers are the same either way: the kept
    weight is the one a call would dequantise. Refused (0) where the dense weights would
    take more than half the memory available, and then every call dequantises, as before.
    """
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    itemsize = 2 if dtype == torch.bfloat16 and bf16_gemm() else 4
    need = itemsize * sum(m.out_features * m.in_features for m in layers)
    free = available_bytes()
    if on and free is not None and 2 * need > free:
        on = False
    for m in layers:
        m.keep_dense = on
        if not on:
            m._dense = None
    return need if on else 0
