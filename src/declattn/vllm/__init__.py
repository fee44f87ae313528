"""Declarative Attention on vLLM, as a plugin: no fork, vLLM's own kernels read fewer pages.

- ``build_request(context, question, tokenizer)``: the DA prompt (token ids) and the flat
  per-request args our engine core side reads (``xargs.py``);
- ``DALogitsProcessor`` (``processor.py``): follows each DA request's output in vLLM's
  engine core, feeds the tag reader, keeps the scope; teacher forcing and the focus-id
  constraint;
- ``patch.py``: compacts DA decode rows of the block table in the attention metadata
  builder, so the stock kernel reads only the kept blocks.

Importing this package does not import vLLM; the processor and the patch do.
"""

from __future__ import annotations

from typing import Any

from declattn.vllm.request import VllmDARequest, build_request
from declattn.vllm.xargs import BadDAArgs, DASpec, parse

PROCESSOR_FQCN = "declattn.vllm.processor:DALogitsProcessor"
"""What to pass as ``--logits-processors`` (or in ``LLM(logits_processors=[...])``)."""

__all__ = [
    "PROCESSOR_FQCN",
    "BadDAArgs",
    "DALogitsProcessor",
    "DASpec",
    "VllmDARequest",
    "build_request",
    "parse",
]


def __getattr__(name: str) -> Any:
    if name == "DALogitsProcessor":
        from declattn.vllm.processor import DALogitsProcessor

        return DALogitsProcessor
    raise AttributeError(name)
