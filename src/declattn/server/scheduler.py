"""Continuous batching: one thread owns the engine; requests join and leave between steps.

The event loop never touches the engine. It hands a prepared request to ``submit`` and
reads the request's own ``asyncio.Queue``; the stepping thread admits requests, steps
the engine, and posts each request's output to its queue with
``loop.call_soon_threadsafe``. Between two steps the thread

1. drops cancelled requests (a client that went away): ``engine.abort`` frees blocks;
2. admits queued requests in arrival order while the batch has room and the KV pool
   has the blocks for the request's prompt (beyond those the admitted but not yet
   prefilled requests will take). Nothing is reserved for ``max_tokens``: a response
   takes blocks as it grows, and when the pool runs out the engine preempts the running
   request holding the most blocks, which resumes by recompute later. So one long
   request cannot hold the pool while short ones wait behind it;
3. ends requests past their deadline (``--request-timeout`` or the request's own
   ``timeout``) with what they wrote so far;
4. runs one engine step: a decode row of every running request and, beside them, a
   piece of the prompt first in line (a mixed step: ``engine/scheduler.py``).

A failure fails the requests it belongs to, never the thread: a controller's exception
is fenced per request (``Guarded``); any other failure of a step fails the sequences of
that step (the engine's ``next_batch``). Their blocks are freed and stepping goes on.

Text goes out as the tag reader allows: for DA, only up to ``reader.safe_end`` (a tag is
never shown half written), as ``Engine._stream`` does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from declattn.api.session import DASession, Session
from declattn.engine.request import Request, TokenEvent
from declattn.protocol.tags import Declaration
from declattn.server.controllers import ERROR_REASON, Guarded
from declattn.server.errors import APIError
from declattn.server.metrics import Metrics
from declattn.server.prepare import Prepared

if TYPE_CHECKING:
    from declattn.api import Engine

log = logging.getLogger("declattn.server")

TIMEOUT_REASON = "timeout"
_OPENAI_REASON = {"length": "length", "runaway:no_answer": "length", TIMEOUT_REASON: "length"}
"""Engine finish reasons that OpenAI calls ``length``; every other one is ``stop``."""


class QueueFull(Exception):
    """The admission queue is at its limit; the client should retry later."""


# -- what a request's queue receives -------------------------------------------------
@dataclass(frozen=True)
class TextOut:
    """Text that is safe to show (tags decided; stripped if the request asked)."""

    text: str


@dataclass(frozen=True)
class Started:
    """The first token exists: a stream may open even if its text is still held back
    (a multibyte character split across tokens, a tag not yet decided)."""


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    engine_reason: str
    usage: dict[str, Any]
    declarations: list[dict[str, Any]] | None


@dataclass(frozen=True)
class Failed:
    error: APIError


Event = Started | TextOut | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request from submission to its last event."""

    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    guard: Guarded
    submitted: float = field(default_factory=time.monotonic)
    seq: Request | None = None
    shown: int = 0
    started: bool = False
    cancelled: bool = False
    done: bool = False

    @property
    def deadline(self) -> float | None:
        t = self.prepared.timeout_s
        return None if t is None else self.submitted + t

    def post(self, event: Event) -> None:
        if isinstance(event, Finished | Failed):
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True


@dataclass(frozen=True)
class Snapshot:
    """Scheduler state for ``/metrics`` and ``/health``, published after every step."""

    queued: int = 0
    running: int = 0
    prefilling: int = 0
    blocks_in_use: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0
    cache_hits: int = 0
    cache_lookups: int = 0
    steps: int = 0
    alive: bool = False


class Scheduler:
    """The stepping thread and its admission queue."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        *,
        max_batch: int = 32,
        max_queue: int = 256,
        idle_wait: float = 0.05,
    ) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.engine = engine
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.idle_wait = idle_wait
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._cancels: list[Job] = []
        self._active: dict[int, Job] = {}
        self._stopping = False
        self._news = False  # a submit or cancel since the loop last looked
        self._thread: threading.Thread | None = None
        self._snapshot = Snapshot(blocks_free=engine.pool.free)
        self._steps = 0

    # -- event-loop side -----------------------------------------------------------
    def start(self) -> None:
        """Start the stepping thread (idempotent)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="declattn-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop stepping; requests still queued or running fail with 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prepared: Prepared, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; raises ``QueueFull`` past the queue limit."""
        self.start()
        job = Job(prepared, loop, asyncio.Queue(), Guarded(prepared.session))
        with self._cond:
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests already wait for admission")
            self._pending.append(job)
            self._news = True
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: stop the request and free its blocks (between steps)."""
        with self._cond:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            self._cancels.append(job)
            self._news = True
            self._cond.notify_all()

    def snapshot(self) -> Snapshot:
        return self._snapshot

    # -- stepping thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
                cancels, self._cancels = self._cancels, []
                self._news = False
            worked = False
            try:
                self._drop(cancels)
                self._expire(time.monotonic())
                self._admit()
                self._publish()  # reservations are visible before any event of this step
                worked = self.engine.has_work
                if worked:
                    self._step()
            except Exception:  # a bug of our own: log it, keep serving
                log.exception("scheduler iteration failed")
                self._fail_all_active(APIError(500, "internal error in the engine loop"))
            self._publish()
            if not worked:
                with self._cond:  # idle (or waiting for blocks): sleep until news
                    if not self._news and not self._stopping:
                        self._cond.wait(self.idle_wait)
        self._shutdown()

    def _drop(self, cancels: list[Job]) -> None:
        for job in cancels:
            with self._cond:
                dropped = job in self._pending
                if dropped:
                    self._pending.remove(job)
            if job.seq is not None and job.seq.seq_id in self._active:
                del self._active[job.seq.seq_id]
                self.engine.abort(job.seq, "cancelled")
                dropped = True
            job.done = True
            if dropped:  # not one that finished while its cancel was on its way
                self.metrics.count_cancelled()

    def _expire(self, now: float) -> None:
        """End requests past their deadline: queued ones with a 408, running ones with
        what they wrote so far (their finish reason says ``timeout``)."""
        with self._cond:
            late = [j for j in self._pending if j.deadline is not None and now >= j.deadline]
            for job in late:
                self._pending.remove(job)
        for job in late:
            job.post(Failed(APIError(
                408, f"the request waited {job.prepared.timeout_s:g} s (its timeout) without "
                "being admitted; retry later or raise the timeout", code="timeout",
            )))
        for job in list(self._active.values()):
            if job.seq is not None and job.deadline is not None and now >= job.deadline:
                self._active.pop(job.seq.seq_id, None)
                self.engine.abort(job.seq, TIMEOUT_REASON)
                self._flush(job)
                self._finish(job, job.seq, TIMEOUT_REASON)

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._pending or len(self._active) >= self.max_batch:
                    return
                job = self._pending[0]
                if job.cancelled:
                    self._pending.popleft()
                    continue
                if job.prepared.blocks_needed > self.engine.pool.free - self._claimed():
                    return  # first come, first served: wait for blocks to free up
                self._pending.popleft()
            self._start_job(job)

    def _claimed(self) -> int:
        """Blocks that admitted requests still waiting for their prefill will take."""
        bs = self.engine.block_size
        return sum(
            -(-(len(j.seq.prompt_ids) - j.seq.prefilled) // bs) + 1
            for j in self._active.values()
            if j.seq is not None and j.seq.prefilled < len(j.seq.prompt_ids)
        )

    def _start_job(self, job: Job) -> None:
        p = job.prepared
        try:
            seq = self.engine.add(job.guard, p.params)
        except Exception as e:
            job.post(Failed(APIError(500, f"the engine refused the request: {e}")))
            return
        job.seq = seq
        self._active[seq.seq_id] = job
        self.metrics.observe_queue_wait(time.monotonic() - job.submitted)

    def _step(self) -> None:
        # the sequences this step works on: the decoding batch and the one whose piece
        # goes along (taken before the step: a row that finished before the failure is
        # in it too)
        victims = self.engine.next_batch()
        try:
            events = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            for seq in victims:
                self._fail_seq(seq, APIError(500, f"engine failure: {type(e).__name__}: {e}"))
            return
        self._steps += 1
        self._publish()  # a client that sees this step's token sees the blocks it holds
        for event in events:
            job = self._active.get(event.seq_id)
            if job is None:
                continue
            try:
                self._deliver(job, event)
            except Exception as e:  # formatting a result must not stop the others
                log.exception("delivering a token failed")
                self._fail_seq(job.seq, APIError(500, f"internal error: {e}"))

    def _fail_seq(self, seq: Request | None, error: APIError) -> None:
        if seq is None:
            return
        self.engine.abort(seq, ERROR_REASON)
        job = self._active.pop(seq.seq_id, None)
        if job is not None:
            self.metrics.count_failed()
            self._publish()  # a client that sees its error sees the blocks freed
            job.post(Failed(error))

    def _fail_all_active(self, error: APIError) -> None:
        for job in list(self._active.values()):
            self._fail_seq(job.seq, error)

    def _deliver(self, job: Job, event: TokenEvent) -> None:
        seq = job.seq
        assert seq is not None
        finished = event.finish_reason is not None
        self.metrics.count_tokens(1)
        if finished and event.finish_reason == ERROR_REASON and job.guard.error is not None:
            err = job.guard.error
            self._fail_seq(seq, APIError(500, f"request failed: {type(err).__name__}: {err}"))
            return
        if not job.started:
            job.started = True
            job.post(Started())
        self._flush(job, finished)
        if finished:
            self._active.pop(seq.seq_id, None)
            self._finish(job, seq, event.finish_reason or "stop")

    def _flush(self, job: Job, finished: bool = True) -> None:
        """Post the text the session may show now and the job has not shown yet (for
        DA, up to the tag reader's decided offset; all of it once ``finished``)."""
        sess = job.prepared.session
        end = sess.visible_end(finished)
        start, job.shown = job.shown, max(job.shown, end)
        text = sess.text[start:end]
        if text and job.prepared.strip_tags:
            text = _strip(text, start, sess.declarations)
        if text and not job.cancelled:
            job.post(TextOut(text))

    def _finish(self, job: Job, seq: Request, reason: str) -> None:
        sess = job.prepared.session
        usage = build_usage(sess, seq, reason)
        self.metrics.count_finished(
            usage["prompt_tokens"],
            usage["attended_tokens"],
            usage["vanilla_attended_tokens"],
            seq.preemptions,
        )
        self.metrics.count_prompt_sources(**usage["prompt_cache"])
        decls = None
        if job.prepared.strip_tags:
            decls = [d.to_dict() for d in sess.declarations]
        self._publish()  # a client that sees its answer sees the blocks freed
        job.post(Finished(_OPENAI_REASON.get(reason, "stop"), reason, usage, decls))

    def _publish(self) -> None:
        with self._cond:
            queued = len(self._pending)
        load = self.engine.load
        pool = self.engine.pool
        self._snapshot = Snapshot(
            queued=queued,
            running=load.running,
            prefilling=load.waiting,
            blocks_in_use=pool.in_use,
            blocks_free=pool.free,
            blocks_cached=pool.cached,
            cache_hits=pool.cache_hits,
            cache_lookups=pool.cache_lookups,
            steps=self._steps,
            alive=not self._stopping,
        )

    def _shutdown(self) -> None:
        error = APIError(503, "the server is shutting down", code="shutting_down")
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for job in pending:
            job.post(Failed(error))
        self._fail_all_active(error)
        self._publish()


def _strip(text: str, start: int, declarations: Sequence[Declaration]) -> str:
    """``text`` (output offsets ``[start, start + len)``) without the declarations' tags."""
    end = start + len(text)
    out, pos = [], start
    for d in declarations:
        if d.end <= start or d.start >= end:
            continue
        out.append(text[pos - start : max(pos, d.start) - start])
        pos = max(pos, d.end)
    out.append(text[pos - start :])
    return "".join(out)


def prompt_cache(seq: Request) -> dict[str, int]:
    """Where the prompt's KV came from: the prefix cache in memory, its disk tier, or the
    prefill (``cached_tokens``, OpenAI's field, is the first two together)."""
    return {
        "memory_tokens": seq.cached_tokens - seq.disk_tokens,
        "disk_tokens": seq.disk_tokens,
        "computed_tokens": len(seq.prompt_ids) - seq.cached_tokens,
    }


def build_usage(sess: Session, seq: Request, reason: str) -> dict[str, Any]:
    """OpenAI's usage, plus attended tokens and (for DA) the DA report.

    ``attended_tokens`` sums, over decode steps, the KV positions attention read;
    ``vanilla_attended_tokens`` is what full attention would have read on those steps.
    """
    totals = sess.accounting.totals()
    prompt, completion = len(seq.prompt_ids), len(seq.output_ids)
    usage: dict[str, Any] = {
        "engine_finish_reason": reason,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
        "prompt_cache": prompt_cache(seq),
        "prefill_seconds": round(seq.prefill_seconds, 6),
        "preemptions": seq.preemptions,
        "decode_seconds": round(seq.decode_seconds, 6),
        "attended_tokens": totals["logical"],
        "vanilla_attended_tokens": totals["vanilla_logical"],
    }
    if sess.note is not None:
        usage["declarative_attention"] = {"arm": sess.arm, "note": sess.note}
    if isinstance(sess, DASession):
        by_mode = sess.accounting.by_mode()
        usage["declarative_attention"] = {
            "arm": sess.arm,
            "answer": sess.answer,
            "finish_reason": reason,
            "chunks": len(sess.chunks),
            "decode_steps": totals["steps"],
            "declarations": [d.to_dict() for d in sess.declarations],
            "declines": [
                {"tag": d.tag, "reason": str(d.declined), "start": d.start}
                for d in sess.declines
            ],
            "attended_tokens_by_mode": {str(m): dict(v) for m, v in by_mode.items()},
            "physical_attended_tokens": totals["physical"],
            "vanilla_physical_attended_tokens": totals["vanilla_physical"],
            "saving": totals["logical_saving"],
        }
    return usage


__all__ = [
    "Event",
    "Failed",
    "Finished",
    "Job",
    "QueueFull",
    "Scheduler",
    "Snapshot",
    "TextOut",
    "build_usage",
]
