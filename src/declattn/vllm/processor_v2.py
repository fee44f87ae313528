"""The DA logits processor on vLLM's Model Runner V2 interface (the GPU default).

Model Runner V2 names a request by a persistent slot (``req_idx``), not a batch row: its
processors get ``add_request(slot, params)`` when a request enters a slot (a slot is
recycled without a removal call, so adding overwrites), and each step's ``apply`` gets a
``LogitsContext`` mapping logits rows to slots. Attention metadata carries the same
mapping (``CommonAttentionMetadata.req_idx``: batch row -> slot), so the builder wrapper
finds a row's tracker by slot.

V2 keeps no host list of a request's tokens in the worker: committed tokens live in the
runner's ``all_token_ids`` buffer on the device (written there by the previous step's
sampler). A DA tracker needs the newest token's text before the next step's metadata is
built, so at each step with DA decode rows this copies exactly the missing tokens of
those rows (normally one each) to the host, and, at a request's first step, its
prompt's chunk spans (the find focus looks phrases up in their text): one gather and
one copy for all DA rows, stream-ordered after the write. (A StreamingLLM baseline
request needs no token: its blocks follow from the step's length.) With async
scheduling off the stream has already drained to that point, so the wait is short;
with it on, the step waits for the previous one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from declattn.vllm import link, support
from declattn.vllm.compact import to_device
from declattn.vllm.state import DAState, plugin_enabled
from declattn.vllm.tracker import RequestTracker
from declattn.vllm.xargs import parse


class V2DAProcessor(LogitsProcessor):
    """Tracks each DA request by its V2 slot; masks logits only where asked."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse(sampling_params.extra_args)  # raises BadDAArgs (a ValueError)

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        self.vllm_config = vllm_config
        self.req_states = req_states
        self.state = DAState(vllm_config, support.V2)
        self.tokens: dict[int, list[int]] = {}  # slot -> output tokens copied so far
        self.enabled = plugin_enabled() and link.lookup(vllm_config) is None
        if self.enabled:
            from declattn.vllm.patch import install

            install()
            link.register(vllm_config, self)

    # -- vLLM interface ------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        self.tokens.pop(req_idx, None)
        spec = parse(sampling_params.extra_args) if self.enabled else None
        if spec is None:
            self.state.drop(req_idx)  # the slot's previous occupant, if it was ours
            return False
        tokens: list[int] = []
        tracker = self.state.add(req_idx, spec, tokens)
        if tracker.follows_output:
            self.tokens[req_idx] = tokens
        return tracker.edits_logits

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        rows = self.state.rows
        slots = ctx.idx_mapping_np
        if not rows or logits.shape[0] != len(slots):
            # several logits rows per request (speculative decoding): the engine's
            # blockers say DA cannot run there, and rows would not map to slots
            return logits
        edit = [(i, int(s), int(ctx.seq_lens_upper_bound_np[i])) for i, s in enumerate(slots)
                if int(s) in rows and rows[int(s)].edits_logits]
        if not edit:
            return logits
        self._fetch([(slot, length) for _, slot, length in edit])
        for i, slot, _ in edit:
            logits[i] = rows[slot].process_logits(logits[i])
        return logits

    # -- for the builder wrapper (patch.DAHost) ------------------------------------
    def row_keys(self, cm: Any) -> Sequence[int] | None:
        return cm.req_idx  # batch row -> slot, on the host

    def refresh(self, cm: Any, rows: Sequence[int]) -> None:
        slots, lens = cm.req_idx, cm.seq_lens_cpu_upper_bound
        self._fetch([(int(slots[r]), int(lens[r])) for r in rows])

    # -- inspection ----------------------------------------------------------------
    def reads(self, label: str) -> list[Any]:
        return self.state.reads(label)

    def report(self, label: str) -> Any:
        return self.state.report(label)

    # -- internals -----------------------------------------------------------------
    def _fetch(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Copy each slot's output tokens up to position ``length - 1`` that the host
        lacks, and the prompt's chunk spans of a DA tracker that has not had them yet:
        one gather and one device-to-host copy for all of them."""
        slot_idx: list[Tensor] = []
        pos_idx: list[Tensor] = []
        sinks: list[tuple[int, Callable[[list[int]], None]]] = []  # (count, receiver)
        for slot, length in wanted:
            tokens = self.tokens.get(slot)
            tracker = self.state.rows.get(slot)
            if tokens is None or tracker is None:
                continue
            if isinstance(tracker, RequestTracker) and tracker.wants_chunks:
                spans = tracker.spec.layout.chunks
                pos = torch.cat([torch.arange(sp.start, sp.end) for sp in spans])
                slot_idx.append(torch.full_like(pos, slot))
                pos_idx.append(pos)
                sinks.append((len(pos), _chunk_receiver(tracker)))
            start = tracker.prompt_len + len(tokens)
            if length > start:
                pos = torch.arange(start, length)
                slot_idx.append(torch.full_like(pos, slot))
                pos_idx.append(pos)
                sinks.append((len(pos), tokens.extend))
        if not slot_idx:
            return
        table = self.req_states.all_token_ids.gpu
        si = to_device(torch.cat(slot_idx), table.device)
        pi = to_device(torch.cat(pos_idx), table.device)
        values = [int(v) for v in table[si, pi].cpu().tolist()]
        at = 0
        for count, receive in sinks:
            receive(values[at : at + count])
            at += count


def _chunk_receiver(tracker: RequestTracker) -> Callable[[list[int]], None]:
    """Split the gathered chunk-span tokens back into the tracker's spans."""
    sizes = [len(sp) for sp in tracker.spec.layout.chunks]

    def receive(values: list[int]) -> None:
        out, at = [], 0
        for n in sizes:
            out.append(values[at : at + n])
            at += n
        tracker.give_chunks(out)

    return receive
