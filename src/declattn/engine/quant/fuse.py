"""Merging the GGUF layers that read the same input: q/k/v per attention, gate/up per MLP.

Why: a decode step calls every matrix once, and a call has a cost of its own besides its
bytes (Python's module call, the op's dispatch, rounding the row to int8, starting the
threads) and starts reading cold. qwen2.5-0.5b's 128-row k and v projections read at a
tenth of the bandwidth of its large matrices for that reason. Merged, a layer makes
four weight calls instead of seven, and the merged call's tiles are one range over the
threads (``GGUFConcat``). The outputs are what the separate layers give, bit for bit.
The merged layers are what the ``stack`` decode route takes (``engine/route.py``).
"""

from __future__ import annotations

from torch import nn

from declattn.engine.models.layers import MLP, Attention
from declattn.engine.quant.linear import GGUFConcat, GGUFLinear


def fuse_gguf_projections(model: nn.Module) -> int:
    """Merge, in place, every attention's q/k/v and every MLP's gate/up whose layers are
    all GGUF layers (after the weights are loaded: the biases are taken as they are).
    Returns how many merged layers were made; a ``Decoder``'s route is chosen afresh
    after (``route.choose_route``)."""
    made = 0
    for module in list(model.modules()):
        if isinstance(module, Attention):
            parts = [module.q_proj, module.k_proj, module.v_proj]
            if all(isinstance(p, GGUFLinear) for p in parts):
                module.fuse_qkv(GGUFConcat(parts))
                made += 1
        elif isinstance(module, MLP):
            parts = [module.gate_proj, module.up_proj]
            if all(isinstance(p, GGUFLinear) for p in parts):
                module.fuse_gate_up(GGUFConcat(parts))
                made += 1
    return made
