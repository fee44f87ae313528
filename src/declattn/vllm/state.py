"""The DA state of one vLLM engine: a tracker per tracked request, and what its reads were.

vLLM has two model runners with two logits-processor interfaces (``processor_v1.py``,
``processor_v2.py``); they differ in how a request is named (a batch row in V1, a
persistent request slot in V2) and in where its tokens come from, not in what DA does
with them. This is the part they share: trackers keyed by the runner's key, the read
log of finished requests, the served tokenizer, and the engine's verdicts (``support``)
with the one warning each deserves.

Nothing here imports vLLM at module level; ``support`` does when asked.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from declattn.da.constrain import VocabCache
from declattn.da.constrain_find import FindVocab
from declattn.da.constrain_open import OpeningVocab
from declattn.vllm import support
from declattn.vllm.streaming import StreamingTracker
from declattn.vllm.tracker import ReadRecord, RequestTracker, Tracker, chunk_ids_of
from declattn.vllm.xargs import DASpec, StreamingSpec

PLUGIN_NAME = "declattn"
FINISHED_KEPT = 256
"""Finished requests whose read logs stay readable (tests, benches); older ones go."""

log = logging.getLogger("vllm.declattn")
"""A child of vLLM's logger: our lines come out in vLLM's format, where its users look."""


def plugin_enabled() -> bool:
    """vLLM's own switch: ``VLLM_PLUGINS`` unset loads every plugin, else only those named."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        return True
    return PLUGIN_NAME in [p.strip() for p in allowed.split(",")]


@dataclass(frozen=True)
class RequestReport:
    """Whether a DA request's reads were really restricted, step by step.

    ``blockers``: engine-wide causes (``support.engine_blockers``) under which no step
    can be restricted; ``decode_steps``: the decode steps the builder wrapper met;
    ``restricted_steps``: those whose block table it compacted (in at least one
    KV-cache group); ``unrestricted``: reason -> steps handed every block for it."""

    label: str
    masking: bool
    blockers: tuple[str, ...]
    decode_steps: int
    restricted_steps: int
    unrestricted: dict[str, int]
    reads: list[ReadRecord] = field(repr=False)

    @property
    def reads_restricted(self) -> bool | None:
        """True when every decode step read only its scope's blocks; False when masking
        is off (DA-nm), the engine cannot skip, or any step read everything; None when no
        decode step was met (a one-token response)."""
        if not self.masking or self.blockers:
            return False
        if self.decode_steps == 0:
            return None
        return not self.unrestricted

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "reads_restricted": self.reads_restricted,
            "blockers": list(self.blockers),
            "decode_steps": self.decode_steps,
            "restricted_steps": self.restricted_steps,
            "unrestricted": dict(self.unrestricted),
        }


@dataclass
class GroupInfo:
    """One KV-cache group as the builder wrapper met it."""

    index: int
    backend: str
    layers: int
    verdict: support.Verdict
    token_bytes: int  # KV bytes per position over the group's layers
    block_size: int


class DAState:
    """Trackers of one engine's tracked requests (DA, and the StreamingLLM baseline), by
    the key its runner names a request by."""

    def __init__(self, vllm_config: Any, runner: str) -> None:
        self.vllm_config = vllm_config
        self.runner = runner
        self.rows: dict[int, Tracker] = {}
        self.finished: deque[tuple[str, RequestReport]] = deque(maxlen=FINISHED_KEPT)
        self.groups: dict[int, GroupInfo] = {}
        self.warned: list[str] = []
        self._blockers: list[support.Verdict] | None = None
        self._tokenizer: Any = None
        self._vocabs = VocabCache()
        self._find_vocabs = VocabCache(FindVocab.from_tokenizer)
        self._opening_vocabs = VocabCache(OpeningVocab.from_tokenizer)

    # -- requests ------------------------------------------------------------------
    def add(self, key: int, spec: DASpec | StreamingSpec, output_ids: Any,
            prompt_ids: Sequence[int] | None = None) -> Tracker:
        """Track a request under ``key`` (replacing whatever was there). ``prompt_ids``:
        the prompt, where the runner hands it over at admission (V1); V2 hands a DA
        tracker the prompt's chunk tokens later (``RequestTracker.give_chunks``)."""
        self.drop(key)
        tracker: Tracker
        if isinstance(spec, StreamingSpec):
            tracker = StreamingTracker(spec)
        else:
            ids_on, find_on = spec.constraints()
            tok = self._load_tokenizer()
            tracker = RequestTracker(
                spec, output_ids, tok,
                vocab=self._vocabs.get(tok) if ids_on else None,
                find_vocab=self._find_vocabs.get(tok) if find_on else None,
                opening_vocab=self._opening_vocabs.get(tok) if spec.needs_tag_vocab else None,
                chunk_ids=chunk_ids_of(prompt_ids, spec.layout),
            )
        self.rows[key] = tracker
        if tracker.masking:
            self.blockers()  # the engine's one warning comes with its first such request
        return tracker

    def drop(self, key: int) -> None:
        tracker = self.rows.pop(key, None)
        if tracker is None:
            return
        report = self._report(tracker)
        for reason, steps in report.unrestricted.items():
            self.warn_once(f"a DA request read every block at {steps} of "
                           f"{report.decode_steps} decode steps: {reason}")
        if tracker.label is not None:
            self.finished.append((tracker.label, report))

    # -- the engine's verdicts -----------------------------------------------------
    def blockers(self) -> list[support.Verdict]:
        """Engine-wide reasons DA cannot skip here (empty when it can); warned once."""
        if self._blockers is None:
            self._blockers = support.engine_blockers(self.vllm_config, self.runner)
            for b in self._blockers:
                self.warn_once(f"DA requests read every block on this engine: {b.line()}")
            for note in support.engine_notes(self.vllm_config, self.runner):
                log.info("declattn: %s", note)
        return self._blockers

    def group(self, builder: Any) -> GroupInfo:
        """The group of ``builder``, with its verdict (computed once per builder)."""
        info = self.groups.get(id(builder))
        if info is None:
            verdict = support.group_verdict(builder)
            spec = builder.kv_cache_spec
            layers = len(builder.layer_names)
            page = int(getattr(spec, "real_page_size_bytes", 0) or 0)
            bs = int(spec.block_size)
            info = GroupInfo(len(self.groups), type(builder).__name__, layers, verdict,
                             page * layers // bs, bs)
            self.groups[id(builder)] = info
            if not verdict.ok and not verdict.by_design:
                self.warn_once(f"DA does not restrict reads in KV-cache group {info.index} "
                               f"({info.backend}, {layers} layers): {verdict.line()}")
        return info

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.append(message)
            log.warning("declattn: %s", message)

    # -- inspection ----------------------------------------------------------------
    def report(self, label: str) -> RequestReport:
        """The report of the DA request labelled ``label`` (running or finished)."""
        for tracker in self.rows.values():
            if tracker.label == label:
                return self._report(tracker)
        for name, report in reversed(self.finished):  # the newest first
            if name == label:
                return report
        raise KeyError(f"no DA request labelled {label!r}")

    def reads(self, label: str) -> list[ReadRecord]:
        """The read log of the DA request labelled ``label``: one record per decode step
        and KV-cache group that the builder compacted."""
        return list(self.report(label).reads)

    def _report(self, tracker: Tracker) -> RequestReport:
        restricted = {r.step for r in tracker.reads}
        unrestricted: dict[str, int] = {}
        for step, reason in tracker.noted.items():
            if step not in restricted:
                unrestricted[reason] = unrestricted.get(reason, 0) + 1
        blockers = tuple(b.reason for b in self.blockers()) if tracker.masking else ()
        return RequestReport(
            label=tracker.label or "",
            masking=tracker.masking,
            blockers=blockers,
            decode_steps=len(restricted | set(tracker.noted)),
            restricted_steps=len(restricted),
            unrestricted=unrestricted,
            reads=list(tracker.reads),
        )

    # -- the served tokenizer ------------------------------------------------------
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
