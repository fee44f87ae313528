"""The decode route of a loaded model, chosen once, at load, with the reason.

As nano-vllm's model runner settles at start-up how steps will run, ``choose_route``
settles it for a model (the loader calls it; so does anyone who changes its layers):

- ``stack``: a decode step is one native call for every layer (``DecodeStack``,
  ``quant/decode_layers.py``). Needs every projection in GGUF blocks, bf16 or fp32
  activations on CPU, and the native extension with decode attention, the GGUF matmul
  and RMSNorm/RoPE switched on. The paged attention plans the step's reads up front and
  records them after (``PlannedDecode``).
- ``modules``: the module tree, layer by layer, calling the ``AttentionFn`` per layer:
  dense weights, another device, or a kernel missing or switched off. ``why`` says which.

Prefill chunks run the modules on either route (many rows: the GEMM way). On the stack
route, a decode step whose reads cannot be planned up front (a query-aware controller
picks each layer's blocks from its query; a benchmark forcing the torch decode kernel)
runs the same native ops layer by layer around the ``AttentionFn``, and a step they
cannot compute as the modules do (a batch of 32 or more sequences, a gradient wanted)
runs the modules: both are counted by reason (``DecodeRoute.missed``), never silent.
"""

from __future__ import annotations

from declattn.engine import native
from declattn.engine.models.decoder import Decoder, DecodeRoute
from declattn.engine.quant.decode_layers import GGUFDecodeLayers
from declattn.engine.quant.kernel import decode_layer_ops

__all__ = ["DecodeRoute", "choose_route"]


def _blocker(model: Decoder) -> str | None:
    """Why the model's decode steps cannot take the stack, in the order a user would fix
    it; ``None`` where they can."""
    device = model.norm.weight.device
    if device.type != "cpu":
        return f"on {device} (the stack is CPU code)"
    lib = native.library()
    if lib is None:
        return "the native extension is unavailable (see its warning)"
    if native.decode_op() is None:
        return f"decode attention runs on torch ops ({native.ENV_SWITCH}=torch)"
    if decode_layer_ops() is None:
        return ("the GGUF matmul or RMSNorm/RoPE runs on torch ops "
                "(DECLATTN_GGUF_KERNEL or DECLATTN_LAYER_KERNEL=torch)")
    return None


def choose_route(model: Decoder) -> DecodeRoute:
    """Decide how ``model``'s decode steps run, give it that route, and return it."""
    layers = GGUFDecodeLayers.layers_of(model)  # the weights first: they say more to a user
    why_not = layers if isinstance(layers, str) else _blocker(model)
    if why_not is not None:
        route = DecodeRoute("modules", why_not)
    else:
        lib = native.library()
        assert lib is not None and not isinstance(layers, str), "_blocker checked both"
        why = (f"{len(layers)} layers of GGUF blocks, one native call per decode step "
               f"(native build {lib.variant})")
        route = DecodeRoute("stack", why, GGUFDecodeLayers(layers, model.norm.weight.dtype))
    model.use_route(route)
    return route
