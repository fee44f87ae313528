"""``declattn serve``: an OpenAI-compatible server with Declarative Attention per request."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from declattn.cli.common import (
    UserError,
    add_dtype_arg,
    add_kv_cache_args,
    add_model_arg,
    console,
    kv_cache_kwargs,
    user_errors,
)

API_KEY_ENV = "DECLATTN_API_KEY"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (DA per request)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
        "/metrics. A chat request runs with Declarative Attention when it carries a "
        '"declarative_attention" object (see docs/server.md).',
    )
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=32,
                   help="sequences decoded together at most (default 32)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV pool size in blocks of 16 tokens (default 4096)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for admission before new ones get 503 (default 256)")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="clip every request's max_tokens to this")
    p.add_argument("--default-max-tokens", type=int, default=512,
                   help="max_tokens of a chat request that names none (default 512)")
    p.add_argument("--model-id", default=None,
                   help="the name clients use for the model (default: the --model value, or "
                   "a file's stem)")
    add_dtype_arg(p, ("fp16",))
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never reuse an earlier prompt's KV (on by default)")
    add_kv_cache_args(p)
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode each request in a model call of its own, so greedy text never "
                   "depends on the batch (slower under concurrent load; docs/server.md)")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens one step computes beside the running requests' decode "
                   "rows: lower keeps streams flowing, higher gives new prompts their first "
                   "token sooner (default 128; docs/server.md)")
    p.add_argument("--prefill-first", action="store_true",
                   help="run a prompt's prefill alone, pausing every stream meanwhile (the "
                   "scheduling before mixed steps, for comparison)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    limits = p.add_argument_group("limits and access (see docs/server.md)")
    limits.add_argument("--max-request-bytes", type=int, default=None,
                        help="largest request body accepted, in bytes; larger gets 413 "
                        "(default 16777216, 16 MiB)")
    limits.add_argument("--body-timeout", type=float, default=None,
                        help="seconds a request body may take to arrive, plus 1 s per 64 KiB "
                        "received; later gets 408 (default 30)")
    limits.add_argument("--header-timeout", type=float, default=None,
                        help="seconds a connection may take to send a request's line and "
                        "headers before it is closed (default 10)")
    limits.add_argument("--prepare-workers", type=int, default=None,
                        help="requests tokenised at once, one worker kept for small ones "
                        "(default 4)")
    limits.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take, queue included; past it the "
                        "response ends with what it wrote, finish reason 'timeout' in its "
                        "usage (default: no limit; a request's own 'timeout' may ask less)")
    limits.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every request (default: "
                        f"${API_KEY_ENV}, else no key)")
    limits.add_argument("--open-paths", default=None,
                        help="comma-separated paths served without the key (default "
                        "/health,/metrics; '' for none)")
    limits.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host names served, '*.example.com' for "
                        "subdomains (default: any)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def model_id(model: str) -> str:
    """What ``/v1/models`` lists: a shipped name as given, a path by its file or dir name."""
    from declattn.engine.registry import MODELS

    if model in MODELS:
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def run(args: argparse.Namespace) -> int:
    config = server_config(args)
    out = console(stderr=True)
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = load_engine(args.model, dtype=args.dtype, device=args.device,
                                 **kv_cache_kwargs(args))
    serve(engine, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def server_config(args: argparse.Namespace) -> Any:
    """The ``ServerConfig`` the flags ask for (the key from ``$DECLATTN_API_KEY`` when
    ``--api-key`` is not given); a bad value is a ``UserError``."""
    from declattn.server.app import DEFAULT_KV_BLOCKS, ServerConfig

    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--kv-blocks", args.kv_blocks, 1),
        ("--max-queue", args.max_queue, 1),
        ("--max-tokens-cap", args.max_tokens_cap, 1),
        ("--default-max-tokens", args.default_max_tokens, 1),
        ("--port", args.port, 0),
        ("--max-request-bytes", args.max_request_bytes, 1),
        ("--prepare-workers", args.prepare_workers, 1),
        ("--prefill-budget", args.prefill_budget, 1),
    ):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}")
    for flag, seconds in (("--body-timeout", args.body_timeout),
                          ("--header-timeout", args.header_timeout),
                          ("--request-timeout", args.request_timeout)):
        if seconds is not None and not seconds > 0:
            raise UserError(f"{flag} must be more than 0 seconds")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise UserError(f"--api-key (or ${API_KEY_ENV}) is empty")
    name = args.model_id or model_id(args.model)
    config = ServerConfig(
        model_id=name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        kv_blocks=args.kv_blocks or DEFAULT_KV_BLOCKS,
        max_tokens_cap=args.max_tokens_cap,
        default_max_tokens=args.default_max_tokens,
        aliases=tuple({args.model} - {name}),
        prefix_caching=not args.no_prefix_cache,
        batch_invariant=args.batch_invariant,
        prefill_budget=args.prefill_budget,
        prefill_first=args.prefill_first,
        request_timeout_s=args.request_timeout,
        freeze_heap=True,  # this process only serves
        api_key=api_key,
        allowed_hosts=_names(args.allowed_hosts),
        **_given(
            max_request_bytes=args.max_request_bytes,
            body_timeout_s=args.body_timeout,
            header_timeout_s=args.header_timeout,
            prepare_workers=args.prepare_workers,
            open_paths=_names(args.open_paths),
        ),
    )
    return config


def _given(**options: Any) -> dict[str, Any]:
    """The options given on the command line; the others keep ``ServerConfig``'s default."""
    return {k: v for k, v in options.items() if v is not None}


def _names(value: str | None) -> tuple[str, ...] | None:
    """``"a, b"`` -> ``("a", "b")``; ``None`` stays ``None``."""
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def load_engine(
    model: str, dtype: str | None = None, device: str | None = None, **kv_cache: Any
) -> Any:
    """The facade for a server; its own KV pool is never allocated (the server makes one
    of ``--kv-blocks``). ``kv_cache``: ``kv_cache_kwargs`` (the prefix cache's disk tier)."""
    from declattn.api import Engine

    return Engine.from_pretrained(model, dtype=dtype, device=device, **kv_cache)


def serve(engine: Any, config: Any, *, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    from declattn.server.app import create_app
    from declattn.server.connection import uvicorn_config

    with user_errors():
        app = create_app(engine, config)
    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                  header_timeout_s=config.header_timeout_s)).run()
