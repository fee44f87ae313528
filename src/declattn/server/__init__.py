"""``declattn serve``: an OpenAI-compatible HTTP server with Declarative Attention.

``create_app(engine, ServerConfig(...))`` returns the FastAPI app; ``declattn serve``
loads a model and runs it under uvicorn. See ``docs/server.md`` for the API. ``client``
talks to such a server with httpx only; the app (FastAPI, the engine) loads on first use,
so importing the client stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from declattn.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'declattn.server' has no attribute {name!r}")
