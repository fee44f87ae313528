"""``declattn serve``: an OpenAI-compatible server with Declarative Attention per request."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from declattn.cli.common import UserError, add_model_arg, console, user_errors


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
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
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
    from declattn.server.app import DEFAULT_KV_BLOCKS, ServerConfig

    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--kv-blocks", args.kv_blocks, 1),
        ("--max-queue", args.max_queue, 1),
        ("--max-tokens-cap", args.max_tokens_cap, 1),
        ("--default-max-tokens", args.default_max_tokens, 1),
        ("--port", args.port, 0),
    ):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}")
    name = args.model_id or model_id(args.model)
    config = ServerConfig(
        model_id=name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        kv_blocks=args.kv_blocks or DEFAULT_KV_BLOCKS,
        max_tokens_cap=args.max_tokens_cap,
        default_max_tokens=args.default_max_tokens,
        aliases=tuple({args.model} - {name}),
    )
    out = console(stderr=True)
    with user_errors():
        with out.status(f"loading {args.model}"):
            engine = load_engine(args.model, dtype=args.dtype, device=args.device)
    serve(engine, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def load_engine(model: str, dtype: str | None = None, device: str | None = None) -> Any:
    """The facade for a server: its own KV pool stays one block, the server makes its own."""
    from declattn.api import Engine
    from declattn.engine.loader import load_model
    from declattn.engine.registry import resolve_model

    torch_dtype = None
    if dtype is not None:
        import torch

        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    loaded = load_model(resolve_model(model), dtype=torch_dtype, device=device)
    return Engine(loaded, kv_tokens=1)


def serve(engine: Any, config: Any, *, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    from declattn.server.app import create_app

    app = create_app(engine, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
