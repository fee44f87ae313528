"""vLLM's general-plugin entry point (group ``vllm.general_plugins``, name ``declattn``).

vLLM calls ``register`` in every process it starts, the engine core included, which is
where the attention metadata builders run; a patch made only in the parent process
would never see a decode step. The logits processor installs the same patch when the
engine core builds it, so passing the processor by name works without the entry point.
"""

from __future__ import annotations


def register() -> None:
    """Wrap the attention metadata builders (idempotent; inert without DA requests)."""
    from declattn.vllm.patch import install

    install()
