"""The DA logits processor on vLLM's V1 model-runner interface.

The V1 runner (the CPU build's, and the GPU's fallback when Model Runner V2 cannot run)
gives logits processors the batch's changes (requests added with their prompt and a
live reference to their output-token list, removed, moved) before every forward pass,
and the batch's logits after it. The prompt's chunk spans go to the tracker at
admission (a find focus looks its phrase up in their text). A request is named by its
batch row, which is also its row in the block table the attention metadata builder
sees, so the builder wrapper reads trackers by row and never needs a token copied: the
runner appends each sampled token to the live list before it builds the next step's
metadata (with async scheduling off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from declattn.vllm import link, support
from declattn.vllm.state import DAState, plugin_enabled
from declattn.vllm.tracker import RequestTracker
from declattn.vllm.xargs import parse


class V1DAProcessor(LogitsProcessor):
    """Tracks each DA request's scope by batch row; masks logits only where asked."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse(sampling_params.extra_args)  # raises BadDAArgs (a ValueError)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.state = DAState(vllm_config, support.V1)
        # One processor per engine: a second one (entry point plus --logits-processors)
        # stays inert rather than track every request twice.
        self.enabled = plugin_enabled() and link.lookup(vllm_config) is None
        if self.enabled:
            from declattn.vllm.patch import install

            install()  # we run in the engine core, where the builders live
            link.register(vllm_config, self)

    @property
    def rows(self) -> dict[int, Any]:
        return self.state.rows

    # -- vLLM interface ------------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        # Forcing and the constraint change the argmax; switched off, the processor is
        # filed with the invariant ones, which greedy sampling never calls.
        return not self.enabled

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.enabled:
            return
        rows = self.state.rows
        for index in batch_update.removed:
            self.state.drop(index)
        for index, params, prompt, output_ids in batch_update.added:
            spec = parse(params.extra_args)
            if spec is None:
                self.state.drop(index)
                continue
            tracker = self.state.add(index, spec, output_ids, prompt)
            if isinstance(tracker, RequestTracker) and tracker.wants_chunks:
                self.state.warn_once(
                    "a DA request arrived without the token prompt its layout describes "
                    "(a prompt of embeddings, or a layout of another prompt): its find "
                    "declarations are declined")
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                ta, tb = rows.pop(a, None), rows.pop(b, None)
                if tb is not None:
                    rows[a] = tb
            else:
                # A one-way move replaces whatever sat at ``b``: vLLM reports a request
                # that finished there only this way, not as removed.
                ta = rows.pop(a, None)
                self.state.drop(b)
            if ta is not None:
                rows[b] = ta

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, tracker in self.state.rows.items():
            if row < logits.shape[0] and tracker.edits_logits:
                logits[row] = tracker.process_logits(logits[row])
        return logits

    # -- for the builder wrapper (patch.DAHost) ------------------------------------
    def row_keys(self, cm: Any) -> Sequence[int]:
        return range(int(cm.num_reqs))  # the batch row is the key

    def refresh(self, cm: Any, rows: Sequence[int]) -> None:
        return None  # the output lists are live

    # -- inspection ----------------------------------------------------------------
    def reads(self, label: str) -> list[Any]:
        return self.state.reads(label)

    def report(self, label: str) -> Any:
        return self.state.report(label)
