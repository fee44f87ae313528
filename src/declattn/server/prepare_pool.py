"""Request preparation in worker threads, several at once, each with a tokenizer of its own.

Preparing a request (segmenting, rendering, tokenising) takes from a millisecond to
seconds for a context of megabytes. It runs off the event loop, in a small pool of
threads, so a big request never holds a small one behind it:

- each worker tokenises with a copy of the tokenizer of its own. A Hugging Face fast
  tokenizer keeps ``split_special_tokens`` as state on its Rust tokenizer, set by each
  call that passes it: a DA render in one thread makes a plain prompt tokenised at the
  same moment in another lose its special tokens (24 of 200 plain calls did, two threads
  on SmolLM2's tokenizer). The engine's ``tokenizer`` becomes a ``ThreadTokenizer``,
  which hands each worker its copy and every other thread (the engine's decoding) the
  original, so whatever the facade tokenises with, a worker never shares state, and the
  caches keyed by the tokenizer (the focus vocabularies) still see one tokenizer;
- requests over ``big_bytes`` may use all but one worker, so one stays free for small
  requests however many big ones arrive (those wait their turn on the event loop, not in
  a thread).

The tokenizer's Rust code releases the GIL, so the workers really run side by side.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_WORKERS = 4
BIG_REQUEST_BYTES = 64 * 1024
"""A body over this (about 16k tokens of text) takes a worker of the big requests' share."""


class ThreadTokenizer:
    """A tokenizer that is a private copy in each thread that ``adopt``-ed one, and the
    original everywhere else. Attribute access, calls and ``len`` go to that tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._original = tokenizer
        self._local = threading.local()

    def adopt(self) -> None:
        """Give the calling thread a copy of its own (a fraction of a second, a few MB)."""
        self._local.tokenizer = copy.deepcopy(self._original)

    @property
    def current(self) -> Any:
        """The tokenizer the calling thread uses."""
        return self._local.__dict__.get("tokenizer", self._original)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.current(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.current)


class PreparePool:
    """Runs ``fn(engine)`` in a worker thread; see the module's docstring.

    The pool makes ``engine.tokenizer`` a ``ThreadTokenizer`` (once; an engine of the
    server's own, from ``with_pool``, so no other user of the model sees it)."""

    def __init__(self, engine: Any, workers: int = DEFAULT_WORKERS,
                 big_bytes: int = BIG_REQUEST_BYTES) -> None:
        if workers < 1:
            raise ValueError(f"prepare workers must be at least 1, got {workers}")
        if not isinstance(engine.tokenizer, ThreadTokenizer):
            engine.tokenizer = ThreadTokenizer(engine.tokenizer)
        self.engine = engine
        self.tokenizer: ThreadTokenizer = engine.tokenizer
        self.workers = workers
        self.big_bytes = big_bytes
        self._big = asyncio.Semaphore(max(1, workers - 1))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="declattn-prepare",
                                            initializer=self.tokenizer.adopt)

    def start(self) -> None:
        """Start every worker now, each copying the tokenizer, rather than on the first
        requests (blocks until they are all up)."""
        barrier = threading.Barrier(self.workers)
        for done in [self._executor.submit(barrier.wait) for _ in range(self.workers)]:
            done.result()

    async def run(self, fn: Callable[[Any], T], body_bytes: int = 0) -> T:
        """``fn(engine)``, computed in a worker; a request of ``body_bytes`` over
        ``big_bytes`` first waits for a place among the big ones."""
        loop = asyncio.get_running_loop()
        if self.workers == 1 or body_bytes <= self.big_bytes:
            return await loop.run_in_executor(self._executor, fn, self.engine)
        async with self._big:
            return await loop.run_in_executor(self._executor, fn, self.engine)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
