"""The FastAPI application: OpenAI-compatible routes over one engine and its scheduler.

``create_app(engine, config)`` builds a server around an already loaded ``Engine``. The
server gets its own paged KV pool (``config.kv_blocks``); the facade supplies the
model, the tokenizer and the per-request DA sessions. Request handlers validate and
prepare off the event loop, submit to the scheduler, and relay what the request's queue
receives, either as one JSON body or as server-sent events.

A streamed request waits for its first token before the response starts, so a failure
before any output (a full queue, an engine error) still gets its real HTTP status; a
failure after that arrives as an ``{"error": ...}`` event, which OpenAI clients raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from declattn.engine.engine import PagedEngine
from declattn.server.errors import APIError, install_handlers
from declattn.server.metrics import CONTENT_TYPE, Metrics
from declattn.server.prepare import Limits, Prepared, prepare_chat, prepare_completion
from declattn.server.responses import DONE, KEEP_ALIVE, Shape
from declattn.server.scheduler import Failed, Finished, Job, QueueFull, Scheduler, TextOut
from declattn.server.schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_KV_BLOCKS = 4096
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it


@dataclass(frozen=True)
class ServerConfig:
    """What ``declattn serve`` was asked for.

    ``max_batch``: sequences in the engine at once (prefilling or decoding);
    ``max_queue``: requests waiting for admission before new ones get 503 (every request
    waits there at least until the next step);
    ``kv_blocks``: the server's KV pool; ``max_tokens_cap``: an upper bound applied to
    every request's ``max_tokens`` (silently, like a provider's output limit);
    ``aliases``: other names the model answers to (the path it was loaded from).
    """

    model_id: str
    max_batch: int = 32
    max_queue: int = 256
    kv_blocks: int = DEFAULT_KV_BLOCKS
    max_tokens_cap: int | None = None
    default_max_tokens: int = 512
    retry_after_s: int = 1
    keep_alive_s: float = 15.0
    aliases: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.kv_blocks < 1:
            raise ValueError("max_batch, max_queue and kv_blocks must be >= 1")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1")


@dataclass
class ServerState:
    """Everything the routes share; one per app (no module-level state)."""

    engine: Any
    config: ServerConfig
    core: PagedEngine
    scheduler: Scheduler
    metrics: Metrics
    limits: Limits
    started: float = field(default_factory=time.time)
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises request preparation. A Hugging Face fast tokenizer keeps
    ``split_special_tokens`` as state on the shared Rust tokenizer (set by each call
    that passes it, never restored), so a DA render in one thread can make a plain
    prompt tokenised at the same moment in another thread lose its special tokens."""

    def warm_up(self) -> None:
        """Build what the first DA request would otherwise wait for (the focus vocabulary
        of the constrained decoding that small models get by default)."""
        from declattn.api import CONSTRAIN_BELOW_PARAMS

        if getattr(self.engine, "n_params", CONSTRAIN_BELOW_PARAMS) < CONSTRAIN_BELOW_PARAMS:
            with self.tokenizer_lock:
                self.engine.focus_vocabs.get(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def prepare(self, fn: Callable[..., Prepared], body: Any) -> Prepared:
        """Run ``fn(engine, body, limits)`` in a worker thread, one at a time."""

        def locked() -> Prepared:
            with self.tokenizer_lock:
                try:
                    return fn(self.engine, body, self.limits)
                except UnicodeError as e:  # JSON can carry lone surrogates; tokenizers refuse
                    raise APIError(
                        400, f"the request holds text that is not valid Unicode ({e.reason})",
                        code="invalid_unicode",
                    ) from e

        return await run_in_threadpool(locked)

    def check_model(self, name: str) -> None:
        if name != self.config.model_id and name not in self.config.aliases:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves "
                f"'{self.config.model_id}'",
                param="model",
                code="model_not_found",
            )


def build_core(engine: Any, kv_blocks: int) -> PagedEngine:
    """A paged engine of its own for the server, over the facade's model and tokenizer."""
    return PagedEngine(
        engine.loaded.model,
        engine.tokenizer,
        num_blocks=kv_blocks,
        block_size=engine.block_size,
        prefill_chunk=engine.core.prefill_chunk,
    )


def create_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The server for ``engine`` (a loaded ``declattn.Engine``)."""
    core = build_core(engine, config.kv_blocks)
    metrics = Metrics()
    scheduler = Scheduler(core, metrics, max_batch=config.max_batch, max_queue=config.max_queue)
    limits = Limits(
        max_positions=engine.loaded.config.max_position_embeddings,
        pool_blocks=config.kv_blocks,
        block_size=core.block_size,
        max_tokens_cap=config.max_tokens_cap,
        default_max_tokens=config.default_max_tokens,
    )
    state = ServerState(engine, config, core, scheduler, metrics, limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        await run_in_threadpool(state.warm_up)
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(
        title="declattn",
        summary="OpenAI-compatible server with Declarative Attention",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.declattn = state
    install_handlers(app)
    app.add_middleware(StatusCounter, metrics=metrics)
    _routes(app, state)
    return app


def _routes(app: FastAPI, s: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        snap = s.scheduler.snapshot()
        ok = s.scheduler.alive or snap.steps == 0
        body = {
            "status": "ok" if ok else "engine stopped",
            "model": s.config.model_id,
            "queued": snap.queued,
            "running": snap.running + snap.prefilling,
            "kv_blocks_free": snap.blocks_free,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = s.metrics.render(s.scheduler.snapshot(), s.config.kv_blocks)
        return Response(text, media_type=CONTENT_TYPE)

    def _model_card() -> dict[str, Any]:
        return {
            "id": s.config.model_id,
            "object": "model",
            "created": int(s.started),
            "owned_by": "declattn",
            "max_model_len": s.limits.max_positions,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        s.check_model(model)
        return _model_card()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion; ``declarative_attention`` runs the request with DA."""
        s.check_model(body.model)
        prepared = await s.prepare(prepare_chat, body)
        include = bool(body.stream_options and body.stream_options.include_usage)
        shape = Shape.new("chat", body.model)
        return await _respond(s, request, prepared, shape, bool(body.stream),
                              include or prepared.is_da)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of a raw prompt (no chat template, no DA)."""
        s.check_model(body.model)
        prepared = await s.prepare(prepare_completion, body)
        include = bool(body.stream_options and body.stream_options.include_usage)
        shape = Shape.new("text", body.model)
        return await _respond(s, request, prepared, shape, bool(body.stream), include)


# -- relaying a request's events ----------------------------------------------------
class _Watch:
    """Races a request's events against its client going away."""

    def __init__(self, request: Request) -> None:
        self._task = asyncio.ensure_future(self._disconnected(request.receive))

    @staticmethod
    async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.01)  # a server that repeats empty body messages

    async def next(self, job: Job) -> Any | None:
        """The job's next event, or ``None`` if the client disconnected first."""
        get = asyncio.ensure_future(job.queue.get())
        done, _ = await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        return None

    def close(self) -> None:
        self._task.cancel()


def _submit(s: ServerState, prepared: Prepared) -> Job:
    try:
        return s.scheduler.submit(prepared, asyncio.get_running_loop())
    except QueueFull as e:
        s.metrics.count_rejected()
        raise APIError(
            503,
            f"the server is at capacity ({e}); retry after {s.config.retry_after_s} s",
            code="queue_full",
            headers={"Retry-After": str(s.config.retry_after_s)},
        ) from e


async def _respond(
    s: ServerState,
    request: Request,
    prepared: Prepared,
    shape: Shape,
    stream: bool,
    include_usage: bool,
) -> Response:
    job = _submit(s, prepared)
    watch = _Watch(request)
    try:
        if not stream:
            return await _collect(s, job, watch, shape)
        first = await watch.next(job)
    finally:
        watch.close()
    if first is None:
        s.scheduler.cancel(job)
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(first, Failed):
        return first.error.response()
    return StreamingResponse(
        _events(s, job, shape, first, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _collect(s: ServerState, job: Job, watch: _Watch, shape: Shape) -> Response:
    pieces: list[str] = []
    while True:
        event = await watch.next(job)
        if event is None:
            s.scheduler.cancel(job)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, TextOut):
            pieces.append(event.text)
        elif isinstance(event, Failed):
            return event.error.response()
        elif isinstance(event, Finished):
            body = shape.response("".join(pieces), event.finish_reason, event.usage,
                                  event.declarations)
            return JSONResponse(body)


async def _events(
    s: ServerState, job: Job, shape: Shape, first: Any, include_usage: bool
) -> AsyncIterator[str]:
    try:
        opening = shape.first_chunk()
        if opening is not None:
            yield opening
        event = first
        while True:
            if isinstance(event, TextOut):
                yield shape.text_chunk(event.text)
            elif isinstance(event, Failed):
                yield event.error.sse()
                yield DONE
                return
            elif isinstance(event, Finished):
                yield shape.finish_chunk(event.finish_reason, event.declarations)
                if include_usage:
                    yield shape.usage_chunk(event.usage)
                yield DONE
                return
            event = None
            while event is None:
                try:
                    event = await asyncio.wait_for(job.queue.get(), s.config.keep_alive_s)
                except TimeoutError:
                    yield KEEP_ALIVE  # also how a silent stream notices its client has gone
    finally:
        if not job.done:
            s.scheduler.cancel(job)


# -- request counting ---------------------------------------------------------------
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class StatusCounter:
    """ASGI middleware counting responses by endpoint and status for ``/metrics``.

    Plain ASGI rather than ``BaseHTTPMiddleware``, which would buffer streams and get in
    the way of disconnect handling."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = next((e for e in _ENDPOINTS if path == e or path.startswith(e + "/")),
                        "other")
        seen = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal seen
            if message["type"] == "http.response.start" and not seen:
                seen = True
                self.metrics.count_request(endpoint, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not seen:
                self.metrics.count_request(endpoint, 500)
            raise
