"""The DA logits processor that vLLM loads: one class for both of its model runners.

vLLM 0.32 loads every ``vllm.logits_processors`` entry point at start-up, whichever
runner the engine will use, and each runner checks the class against its own interface:
Model Runner V2 (the GPU default) refuses anything that is not a subclass of its
``LogitsProcessor`` and stops the engine, DA requested or not; the V1 runner (the CPU
build, and the GPU fallback) constructs whatever the entry point names with its own
arguments, and checks the V1 base class for a processor passed by name. So the one
class the entry point (and ``--logits-processors``) names is a subclass of both bases
and a factory: constructed with V2's arguments ``(vllm_config, req_states)`` it returns
a ``V2DAProcessor``, with V1's ``(vllm_config, device, is_pin_memory)`` a
``V1DAProcessor``. Each of those implements one interface fully; this class holds no
state and is never an instance itself. Importing it pulls in neither runner's side (the
front end loads it only to validate requests).

Requests without DA args get no tracker, and their logits and block-table rows are never
touched. ``VLLM_PLUGINS`` set to a list without ``declattn`` turns the plugin off: the
processor then stays inert.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as V2LogitsProcessor,
)
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

from declattn.vllm.xargs import parse


class DALogitsProcessor(V2LogitsProcessor, V1LogitsProcessor):
    """Entry point for both runners; constructing it builds the runner's own processor."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        if _v2_arguments(args, kwargs):
            from declattn.vllm.processor_v2 import V2DAProcessor

            return V2DAProcessor(vllm_config, *args, **kwargs)
        from declattn.vllm.processor_v1 import V1DAProcessor

        return V1DAProcessor(vllm_config, *args, **kwargs)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Both runners call this in the front end, at admission: a malformed DA request
        is refused there (``BadDAArgs`` is a ``ValueError``)."""
        parse(sampling_params.extra_args)

    # Never reached (``__new__`` returns another class's instance); they satisfy both
    # abstract bases, so the class itself is concrete for vLLM's loaders.
    def apply(self, logits: Any, ctx: Any = None) -> Any:  # pragma: no cover
        raise TypeError("DALogitsProcessor is a factory; vLLM uses what it builds")

    def is_argmax_invariant(self) -> bool:  # pragma: no cover
        raise TypeError("DALogitsProcessor is a factory; vLLM uses what it builds")

    def update_state(self, batch_update: Any) -> None:  # pragma: no cover
        raise TypeError("DALogitsProcessor is a factory; vLLM uses what it builds")


def _v2_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """V2 builds processors as ``ctor(vllm_config, req_states)``; V1 as
    ``ctor(vllm_config, device, is_pin_memory)``."""
    state = kwargs.get("req_states", args[0] if args else None)
    return isinstance(state, LogitsProcRequestState)
