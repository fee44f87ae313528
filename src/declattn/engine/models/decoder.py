"""One decoder-only transformer for Llama, Qwen2, Qwen3 and Gemma 3 text models.

The model owns weights and arithmetic only; where keys and values live and which of them
are read is the ``AttentionFn``'s business (see ``attention_api``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from declattn.engine.attention_api import AttentionFn
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.layers import MLP, Attention, RMSNorm, Rotary
from declattn.engine.models.token_context import TokenContext


class LayerRunner(Protocol):
    """A decode step's layers at once, by another route than the modules (one that computes
    the same, bit for bit: ``quant/decode_layers.py``)."""

    missed: Counter[str]
    """Decode steps it could not run in one call, by reason (and how they ran)."""

    def __call__(
        self,
        h: Tensor,
        rope_global: tuple[Tensor, Tensor],
        rope_local: tuple[Tensor, Tensor],
        attn: AttentionFn,
    ) -> Tensor | None:
        """The layers' output; ``None`` where the modules run the step: one that is not a
        decode step on paged KV (a prefill: by design), or one it counts in ``missed``."""
        ...


@dataclass(frozen=True)
class DecodeRoute:
    """How a ``Decoder``'s decode steps run, chosen once at load (``engine/route.py``):
    ``stack`` (``runner``: every layer in one native call) or ``modules`` (the module tree),
    and why."""

    kind: Literal["stack", "modules"] = "modules"
    why: str = "no route chosen (a model not built by the loader)"
    runner: LayerRunner | None = None

    @property
    def missed(self) -> Counter[str]:
        """Decode steps the stack could not take, by reason: none goes unseen."""
        return self.runner.missed if self.runner is not None else Counter()

    def describe(self) -> str:
        """One line: the route, why, and any decode steps off it."""
        line = f"{self.kind}: {self.why}"
        if self.missed:
            off = "; ".join(f"{n} x {reason}" for reason, n in self.missed.most_common())
            line += f" (decode steps off it: {off})"
        return line


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; Gemma adds a norm after each ("sandwich")."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.attn_norm = RMSNorm(config.hidden_size, eps, offset)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.hidden_size, eps, offset)
        self.mlp = MLP(config)
        if config.sandwich_norms:
            self.post_attn_norm: RMSNorm | None = RMSNorm(config.hidden_size, eps, offset)
            self.post_mlp_norm: RMSNorm | None = RMSNorm(config.hidden_size, eps, offset)
        else:
            self.post_attn_norm = self.post_mlp_norm = None

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        a = self.attn(self.attn_norm(h), cos, sin, attn)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        h = h + a
        m = self.mlp(self.mlp_norm(h))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return h + m


class Decoder(nn.Module):
    """Token ids and positions in, final-normed hidden states out; logits on demand.

    ``logits`` is separate from ``forward`` because a decode step or a prefill needs the
    vocabulary projection for only a few rows, and that projection is the largest matmul
    of a small model.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        )
        # A tied model multiplies by its embedding table for the logits; a quantized load
        # puts a packed copy of that table here (the lookup keeps the exact one).
        self.tied_head: nn.Module | None = None
        self.shift = nn.ModuleList(
            nn.Linear(c.hidden_size, c.hidden_size, bias=False) for _ in range(c.token_shift)
        )
        self.segment_embed = (
            nn.Embedding(c.chunk_segments + 1, c.hidden_size) if c.chunk_segments else None
        )
        self._rotary_global = Rotary(c.rope_global, c.head_dim)
        self._rotary_local = Rotary(c.rope_local, c.head_dim) if c.rope_local else None
        self.decode_route = DecodeRoute()

    def use_route(self, route: DecodeRoute) -> None:
        """Run decode steps by ``route`` (``engine/route.py`` chooses it). Whoever changes
        the layers' modules afterwards chooses again: a runner holds the weights it took."""
        self.decode_route = route

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionFn,
        context: TokenContext | None = None,
    ) -> Tensor:
        """``input_ids``, ``positions``: ``[T]``. Returns ``[T, hidden_size]``.

        ``context`` is required by the ``declattn_tiny`` family and ignored otherwise.
        """
        h = self.embed(input_ids)
        if self.config.embed_scale is not None:
            # Scaled in the model dtype, as the reference implementation does.
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype, device=h.device)
        if self.config.needs_token_context:
            h = h + self._aids(context)
        rope_global = self._rotary_global.cos_sin(positions)
        rope_local = self._rotary_local.cos_sin(positions) if self._rotary_local else rope_global
        run = self.decode_route.runner
        done = run(h, rope_global, rope_local, attn) if run is not None else None
        if done is not None:
            return self.norm(done)
        for i, layer in enumerate(self.layers):
            cos, sin = rope_global if self.config.window(i) is None else rope_local
            h = layer(h, cos, sin, attn)
        return self.norm(h)

    def _aids(self, context: TokenContext | None) -> Tensor:
        if context is None:
            raise ValueError(f"{self.config.architecture} needs each token's context")
        prev = context.previous
        known = (prev >= 0).unsqueeze(-1)
        neighbours = self.embed(prev.clamp(min=0)) * known  # [T, shift, hidden]
        out = sum(proj(neighbours[:, j]) for j, proj in enumerate(self.shift))
        if self.segment_embed is not None:
            segs = context.segments.clamp(max=self.segment_embed.num_embeddings - 1)
            out = out + self.segment_embed(segs)
        return out

    def parameter_count(self) -> int:
        """Weights of the model as trained: a packed layer counts its ``in x out``, not the
        elements of its packed buffers."""
        from declattn.engine.quant.linear import QuantLinear

        packed = [m for m in self.modules() if isinstance(m, QuantLinear)]
        tied = self.tied_head is not None  # a packed copy of the embedding, not more weights
        return sum(p.numel() for p in self.parameters()) + sum(
            m.in_features * m.out_features for m in packed if not (tied and m is self.tied_head)
        )

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: every matrix once (packed or dense);
        of the embedding table only one row, unless it is also the output projection."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        total += sum(b.numel() * b.element_size() for b in self.buffers())
        if self.lm_head is not None or self.tied_head is not None:
            emb = self.embed.weight
            total -= emb.numel() * emb.element_size()
        return total

    def logits(self, hidden: Tensor, *, fp32: bool = True) -> Tensor:
        """Vocabulary logits for the rows of ``hidden`` given: ``[..., vocab_size]``, in
        fp32; with ``fp32=False`` in the head's own dtype where no softcap applies (the
        engine's sampler reads them so: converting a batch's rows, N x vocab, cost a
        decode step more than picking its greedy tokens)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is None:
            out = torch.nn.functional.linear(hidden, self.embed.weight)
        else:
            out = head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            return torch.tanh(out.float() / cap) * cap
        return out.float() if fp32 else out
