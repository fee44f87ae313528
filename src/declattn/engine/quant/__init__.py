"""Weight-only quantized linear layers, read from a GGUF's own blocks (see ``loader``)."""

from declattn.engine.quant.gguf_weights import QuantPolicy
from declattn.engine.quant.linear import GGUFLinear, Int4Linear, Int8Linear, QuantLinear
from declattn.engine.quant.store import QuantSummary

__all__ = ["GGUFLinear", "Int4Linear", "Int8Linear", "QuantLinear", "QuantPolicy", "QuantSummary"]
