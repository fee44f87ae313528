"""Declarative Attention on vLLM, as a plugin: no fork, vLLM's own kernels read fewer pages.

- ``build_request(context, question, tokenizer)``: the DA prompt (token ids) and the flat
  per-request args our engine core side reads (``xargs.py``);
- ``DALogitsProcessor`` (``processor.py``): the class vLLM loads for either model runner
  (``processor_v1.py``, ``processor_v2.py``); follows each DA request's output in the
  engine core, feeds the tag reader (a find focus resolved against the chunk texts it
  decodes from the prompt's chunk spans), keeps the scope (``state.py``, ``tracker.py``);
  teacher forcing and the constraints (focus ids, find phrases); the StreamingLLM
  baseline's requests too (``streaming.py``);
- ``patch.py``: compacts DA decode rows of the block table in the attention metadata
  builder (``compact.py``), so the stock kernel reads only the kept blocks;
- ``support.py``: where that really reaches the kernel, and what to change where not;
- ``doctor.py`` (``declattn doctor``), ``eval_backend.py`` (``declattn eval --backend
  vllm``), ``run.py`` (``declattn run --backend vllm``).

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
