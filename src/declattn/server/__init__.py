"""``declattn serve``: an OpenAI-compatible HTTP server with Declarative Attention.

``create_app(engine, ServerConfig(...))`` returns the FastAPI app; ``declattn serve``
loads a model and runs it under uvicorn. See ``docs/server.md`` for the API.
"""

from declattn.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
