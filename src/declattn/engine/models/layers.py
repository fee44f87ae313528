"""The few building blocks of a decoder layer, each switched by config flags.

Every block works on a flat ``[T, ...]`` batch of tokens: the engine concatenates the new
tokens of all sequences, so nothing here knows about sequences or positions beyond the
``positions`` tensor handed to RoPE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from declattn.engine.attention_api import AttentionFn
from declattn.engine.models import fused
from declattn.engine.models.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """RMS norm computed in fp32; ``unit_offset`` scales by ``1 + weight`` (Gemma's form).

    The weight keeps the checkpoint's own convention so that checkpoints load unchanged.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        fast = fused.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if fast is not None:
            return fast
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequencies (fp32, CPU) for one RoPE config, scaling rules applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between them interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """cos/sin tables for the positions of one step.

    A plain object rather than a module buffer, so that casting the model to bf16 never
    rounds the frequencies.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.inv_freq = rope_inv_freq(rope, head_dim)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[T, H, D]`` in the half-split layout (first half, second half), in fp32."""
    fast = fused.rotary(x, cos, sin)
    if fast is not None:
        return fast
    x32 = x.float()
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.activation = config.activation
        self.gate_up_proj: nn.Module | None = None

    def fuse_gate_up(self, fused: nn.Module) -> None:
        """Compute gate and up through ``fused`` (its output: the two side by side, from
        the two layers' own weights), one call instead of two (``quant/fuse.py``)."""
        self.gate_up_proj = fused

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            gate = F.silu(gate)
        elif self.activation == "gelu_tanh":
            gate = F.gelu(gate, approximate="tanh")
        else:
            gate = F.gelu(gate)
        return self.down_proj(gate * up)


class Attention(nn.Module):
    """q/k/v projections, optional per-head q/k norms, RoPE, then the injected ``AttentionFn``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attn_scale
        self.window = c.window(layer)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_unit_offset)
            self.k_norm: RMSNorm | None = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None

    def fuse_qkv(self, fused: nn.Module) -> None:
        """Compute q, k and v through ``fused`` (its output: the three side by side, from
        the three layers' own weights), one call instead of three (``quant/fuse.py``)."""
        self.qkv_proj = fused

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((self.num_heads * self.head_dim, kv, kv), dim=-1)
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        t = x.shape[0]
        q, k, v = self._qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer, q, k, v, scale=self.scale, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
