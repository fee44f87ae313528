"""The FastAPI application: OpenAI-compatible routes over one engine and its scheduler.

``create_app(engine, config)`` builds a server around an already loaded ``Engine``. The
server gets its own paged KV pool (``config.kv_blocks``); the facade supplies the
model, the tokenizer and the per-request DA sessions. Before a route runs, middleware
checks the host and the API key (``access``) and reads the body under a size limit and a
deadline (``request_body``); the connection's header deadline is in uvicorn's protocol
(``connection``). Request handlers validate, prepare in the worker pool
(``prepare_pool``), submit to the scheduler, and relay what the request's queue
receives, either as one JSON body or as server-sent events.

A streamed request waits for its first token before the response starts, so a failure
before any output (a full queue, an engine error) still gets its real HTTP status; a
failure after that arrives as an ``{"error": ...}`` event, which OpenAI clients raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from declattn.api.heap import frozen_heap
from declattn.server.access import DEFAULT_OPEN_PATHS, Access
from declattn.server.connection import DEFAULT_HEADER_TIMEOUT_S
from declattn.server.errors import APIError, echo, install_handlers
from declattn.server.metrics import CONTENT_TYPE, Metrics
from declattn.server.prepare import Limits, Prepared, prepare_chat, prepare_completion
from declattn.server.prepare_pool import DEFAULT_WORKERS, PreparePool
from declattn.server.request_body import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    BodyGuard,
    body_bytes,
)
from declattn.server.responses import DONE, KEEP_ALIVE, Shape
from declattn.server.scheduler import Failed, Finished, Job, QueueFull, Scheduler, TextOut
from declattn.server.schemas import ChatCompletionRequest, CompletionRequest
from declattn.server.token_bound import token_bound

if TYPE_CHECKING:
    from declattn.api import Engine

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
    ``aliases``: other names the model answers to (the path it was loaded from);
    ``max_request_bytes``, ``body_timeout_s``, ``header_timeout_s``: what a request's
    body may weigh and how long its headers and body may take to arrive;
    ``prepare_workers``: requests prepared (tokenised) at once;
    ``api_key``: required of every request outside ``open_paths``;
    ``allowed_hosts``: the ``Host`` names served (``None``: any);
    ``request_timeout_s``: the most any request may take, queue included (``None``: no
    limit; a request's own ``timeout`` may ask for less);
    ``prefix_caching``: requests that start like an earlier one reuse its prompt K/V (a
    follow-up in a conversation, another question over the same document);
    ``batch_invariant``: each request decodes in a model call of its own, so its greedy
    text never depends on what else runs (slower under load; docs/server.md);
    ``prefill_budget``: prompt tokens one step computes beside the running requests'
    decode rows (``None``: the engine's default); ``prefill_first``: a prompt's pieces
    run alone, before any decode row (the older scheduling, for comparison);
    ``freeze_heap``: while the app runs, the objects built by its start leave the garbage
    collector's full passes (``declattn.api.frozen_heap``): a process-wide setting, so
    ``declattn serve``, which owns its process, turns it on, and an app embedded in
    another program leaves it off unless asked.
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
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    prepare_workers: int = DEFAULT_WORKERS
    api_key: str | None = None
    open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS
    allowed_hosts: tuple[str, ...] | None = None
    prefix_caching: bool = True
    batch_invariant: bool = False
    prefill_budget: int | None = None
    prefill_first: bool = False
    request_timeout_s: float | None = None
    freeze_heap: bool = False

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.kv_blocks < 1:
            raise ValueError("max_batch, max_queue and kv_blocks must be >= 1")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1")
        if self.max_request_bytes < 1 or self.prepare_workers < 1:
            raise ValueError("max_request_bytes and prepare_workers must be >= 1")
        if self.body_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise ValueError("body_timeout_s and header_timeout_s must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0 (None: no limit)")
        if self.prefill_budget is not None and self.prefill_budget < 1:
            raise ValueError("prefill_budget must be >= 1")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (None turns the check off)")


@dataclass
class ServerState:
    """Everything the routes share; one per app (no module-level state)."""

    engine: Engine
    config: ServerConfig
    scheduler: Scheduler
    metrics: Metrics
    limits: Limits
    pool: PreparePool
    """Prepares requests, each worker over a tokenizer of its own (``prepare_pool``)."""
    started: float = field(default_factory=time.time)

    def warm_up(self) -> None:
        """Build what the first requests would otherwise wait for: the workers' tokenizer
        copies, and the focus vocabulary of the constrained decoding that small models
        get by default."""
        from declattn.api import CONSTRAIN_BELOW_PARAMS

        self.pool.start()
        if self.engine.n_params < CONSTRAIN_BELOW_PARAMS:
            self.engine.focus_vocabs.get(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def prepare(self, fn: Callable[..., Prepared], body: Any, request: Request) -> Prepared:
        """``fn(engine, body, limits)`` in a worker of the pool."""

        def run(engine: Any) -> Prepared:
            try:
                return fn(engine, body, self.limits)
            except UnicodeError as e:  # JSON can carry lone surrogates; tokenizers refuse
                raise APIError(
                    400, f"the request holds text that is not valid Unicode ({e.reason})",
                    code="invalid_unicode",
                ) from e

        return await self.pool.run(run, body_bytes(request.scope))

    def check_model(self, name: str) -> None:
        if name != self.config.model_id and name not in self.config.aliases:
            raise APIError(
                404,
                f"The model '{echo(name)}' does not exist; this server serves "
                f"'{self.config.model_id}'",
                param="model",
                code="model_not_found",
            )


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The server for ``engine`` (a loaded ``declattn.Engine``), over a KV pool of its own
    of ``config.kv_blocks`` blocks (the same model serves several apps in tests)."""
    served = engine.with_pool(
        config.kv_blocks,
        prefix_caching=config.prefix_caching,
        batch_invariant=config.batch_invariant,
        prefill_budget=config.prefill_budget,
        prefill_first=config.prefill_first,
    )
    served.allocate()  # a pool that cannot fit is refused now, not at the first request
    metrics = Metrics()
    scheduler = Scheduler(served, metrics, max_batch=config.max_batch, max_queue=config.max_queue)
    limits = Limits(
        max_positions=served.max_positions,
        pool_blocks=config.kv_blocks,
        block_size=served.block_size,
        max_tokens_cap=config.max_tokens_cap,
        default_max_tokens=config.default_max_tokens,
        token_bound=token_bound(served.tokenizer),
        request_timeout_s=config.request_timeout_s,
    )
    pool = PreparePool(served, config.prepare_workers)  # served.tokenizer: one per worker
    state = ServerState(served, config, scheduler, metrics, limits, pool)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        await run_in_threadpool(state.warm_up)
        try:
            with frozen_heap() if config.freeze_heap else contextlib.nullcontext():
                yield  # what is built by now lives as long as the server
        finally:
            await run_in_threadpool(scheduler.stop)
            pool.close()

    app = FastAPI(
        title="declattn",
        summary="OpenAI-compatible server with Declarative Attention",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their JavaScript from a CDN; the schema
        redoc_url=None,  # at /openapi.json works offline in any OpenAPI viewer
    )
    app.state.declattn = state
    install_handlers(app)
    # the last added runs first: count every response, then who may ask, then the body
    app.add_middleware(BodyGuard, max_bytes=config.max_request_bytes,
                       timeout_s=config.body_timeout_s)
    app.add_middleware(Access, api_key=config.api_key, open_paths=config.open_paths,
                       allowed_hosts=config.allowed_hosts)
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
        prepared = await s.prepare(prepare_chat, body, request)
        include = bool(body.stream_options and body.stream_options.include_usage)
        shape = Shape.new("chat", body.model)
        return await _respond(s, request, prepared, shape, bool(body.stream),
                              include or prepared.is_da)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of a raw prompt (no chat template, no DA)."""
        s.check_model(body.model)
        prepared = await s.prepare(prepare_completion, body, request)
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
