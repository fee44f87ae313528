"""A queue of file writes run in order on a thread of their own, off the engine's step.

Why a thread: a chunk's file is a few MB to serialise, hash, write and ``fsync``; done
inline it would lengthen the prefill step it follows, and with it every running
sequence's wait. The engine copies the chunk's K/V out of the pools before it submits
(the pools' blocks may be reused right after), so a job touches nothing the engine
holds, and what it writes becomes visible only by an atomic rename: it cannot corrupt
anything a reader sees.

The thread exists only while jobs wait: it starts with the first and ends when the
queue is empty, so an idle engine holds none. It is not a daemon: at exit the
interpreter waits for the queued writes instead of losing them. At most ``max_pending``
jobs wait (each holds a chunk's K/V); a submit beyond that waits for room.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

Job = Callable[[], None]


class BackgroundWriter:
    """Runs submitted jobs one at a time, in submission order."""

    def __init__(self, on_error: Callable[[BaseException], None], max_pending: int = 4) -> None:
        """``on_error`` receives what a job raised (on the writer's thread); the queue
        goes on with the next job."""
        self._on_error = on_error
        self._max = max_pending
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a thread is running jobs

    def submit(self, job: Job) -> None:
        with self._cond:
            while len(self._jobs) >= self._max:
                self._cond.wait()
            self._jobs.append(job)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._run, name="declattn-kv-writer").start()

    def flush(self) -> None:
        """Wait until every submitted job has run."""
        with self._cond:
            while self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._busy = False
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._cond.notify_all()
            try:
                job()
            except Exception as e:  # a job's own failure must not stop the queue
                self._on_error(e)
