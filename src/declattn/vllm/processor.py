"""The DA logits processor: vLLM's per-request hook into the engine core.

vLLM v1 gives logits processors the batch's changes (requests added with a live
reference to their output-token list, removed, moved) before every forward pass, and
the batch's logits after it. This processor keeps one ``RequestTracker`` per DA request
by batch row, which is all the patched attention metadata builder needs to compact that
row's block table; it also applies teacher forcing and the focus-id constraint to the
logits. Requests without DA args never get a tracker and their logits rows are not
touched.

Enabled by the entry point (installing declattn registers it) or by passing
``logits_processors=[DALogitsProcessor]``. Setting ``VLLM_PLUGINS`` to a list without
``declattn`` turns the whole plugin off, this processor included.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from declattn.vllm import link
from declattn.vllm.tracker import ReadRecord, RequestTracker
from declattn.vllm.xargs import DASpec, parse

PLUGIN_NAME = "declattn"
FINISHED_KEPT = 256
"""Finished requests whose read logs stay readable (tests, benches); older ones go."""


def plugin_enabled() -> bool:
    """vLLM's own switch: ``VLLM_PLUGINS`` unset loads every plugin, else only those named."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        return True
    return PLUGIN_NAME in [p.strip() for p in allowed.split(",")]


class DALogitsProcessor(LogitsProcessor):
    """Tracks each DA request's scope by batch row; masks logits only where asked."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse(getattr(sampling_params, "extra_args", None))  # raises BadDAArgs (a ValueError)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        # One processor per engine: a second one (entry point plus --logits-processors)
        # stays inert rather than track every request twice.
        self.enabled = plugin_enabled() and link.lookup(vllm_config) is None
        self.rows: dict[int, RequestTracker] = {}
        self.finished: deque[tuple[str, list[ReadRecord]]] = deque(
            maxlen=FINISHED_KEPT
        )
        self._tokenizer: Any = None
        self._vocab: Any = None
        self._builders: dict[int, int] = {}
        if self.enabled:
            from declattn.vllm.patch import install

            install()  # we run in the engine core, where the builders live
            link.register(vllm_config, self)

    # -- vLLM interface ------------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        # Forcing and the constraint change the argmax; switched off, the processor is
        # filed with the invariant ones, which greedy sampling never calls.
        return not self.enabled

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.enabled:
            return
        for index in batch_update.removed:
            self._drop(index)
        for index, params, _prompt, output_ids in batch_update.added:
            self._drop(index)
            spec = parse(getattr(params, "extra_args", None))
            if spec is not None:
                self.rows[index] = self._tracker(spec, output_ids)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                ta, tb = self.rows.pop(a, None), self.rows.pop(b, None)
                if tb is not None:
                    self.rows[a] = tb
            else:
                # A one-way move replaces whatever sat at ``b``: vLLM reports a request
                # that finished there only this way, not as removed.
                ta = self.rows.pop(a, None)
                self._drop(b)
            if ta is not None:
                self.rows[b] = ta

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, tracker in self.rows.items():
            if row < logits.shape[0] and (tracker.spec.force or tracker.constraint is not None):
                logits[row] = tracker.process_logits(logits[row])
        return logits

    # -- for the patched builder ---------------------------------------------------
    def kept_blocks(self, row: int, length: int, block_size: int) -> tuple[int, ...] | None:
        tracker = self.rows.get(row)
        return None if tracker is None else tracker.kept_blocks(length, block_size)

    def record(self, row: int, builder: Any, length: int, kept: tuple[int, ...],
               physical: tuple[int, ...], seq_len: int) -> None:
        tracker = self.rows[row]
        if tracker.spec.label is None:
            return  # only labelled requests keep a log: a served request keeps nothing
        scope = tracker.scope()
        group = self._builders.setdefault(id(builder), len(self._builders))
        tracker.reads.append(
            ReadRecord(
                step=tracker.n_out,
                length=length,
                mode=str(scope.mode),
                focus_ids=scope.focus_ids,
                kept=tuple(scope.kept_blocks(length, _block_size(builder))),
                logical=kept,
                physical=physical,
                seq_len=seq_len,
                group=group,
            )
        )

    # -- inspection ----------------------------------------------------------------
    def reads(self, label: str) -> list[ReadRecord]:
        """The read log of the DA request labelled ``label`` (running or finished).

        One record per decode step and KV-cache group that the builder compacted; only
        requests with a ``da_label`` keep one."""
        for tracker in self.rows.values():
            if tracker.spec.label == label:
                return list(tracker.reads)
        for name, reads in reversed(self.finished):  # the newest first
            if name == label:
                return list(reads)
        raise KeyError(f"no DA request labelled {label!r}")

    # -- internals -----------------------------------------------------------------
    def _drop(self, index: int) -> None:
        tracker = self.rows.pop(index, None)
        if tracker is not None and tracker.spec.label is not None:
            self.finished.append((tracker.spec.label, tracker.reads))

    def _tracker(self, spec: DASpec, output_ids: list[int]) -> RequestTracker:
        tokenizer = self._load_tokenizer()
        vocab = None
        if spec.constrain:
            if self._vocab is None:
                from declattn.constrain import FocusVocab

                self._vocab = FocusVocab.from_tokenizer(tokenizer)
            vocab = self._vocab
        return RequestTracker(spec, output_ids, tokenizer, vocab)

    def _load_tokenizer(self) -> Any:
        """The served model's tokenizer, loaded on the first DA request (a Hugging Face
        tokenizer: decoding must match our engine's byte for byte)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            mc = self.vllm_config.model_config
            self._tokenizer = AutoTokenizer.from_pretrained(
                mc.tokenizer, revision=getattr(mc, "tokenizer_revision", None)
            )
        return self._tokenizer


def _block_size(builder: Any) -> int:
    return int(builder.kv_cache_spec.block_size)
