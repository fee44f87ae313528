"""The real server on loopback: uvicorn in a background thread, SmolLM2 loaded once.

Each server gets its own KV pool and scheduler over the one loaded model, so tests can
ask for a small pool or a short queue without loading the model again.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.declattn

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine: Any, **config: Any) -> RunningServer:
    """The server ``declattn serve`` runs (the same app, the same uvicorn settings)."""
    import uvicorn

    from declattn.server import ServerConfig, create_app
    from declattn.server.connection import uvicorn_config

    settings = ServerConfig(model_id=MODEL, **config)
    app = create_app(engine, settings)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning",
                                           header_timeout_s=settings.header_timeout_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


@pytest.fixture(scope="session")
def smol_engine() -> Any:
    """SmolLM2 loaded once for every server test.

    fp32 unless ``DECLATTN_TEST_DTYPE`` says otherwise: the batching test compares greedy
    text batched and alone, and bf16 matmuls on CPU are not batch invariant (a batch of
    64 changes 3 of 64 greedy outputs at the engine level, server or not)."""
    from declattn.cli.serve_cmd import load_engine

    return load_engine(MODEL, dtype=os.environ.get("DECLATTN_TEST_DTYPE", "fp32"))


@pytest.fixture(scope="session")
def server_factory(smol_engine: Any) -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def make(engine: Any = None, **config: Any) -> RunningServer:
        """A server over ``engine`` (SmolLM2 by default) with ``ServerConfig(**config)``."""
        srv = start_server(engine or smol_engine, **config)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


FACTS = [
    ("Ada", "Skerry", "two goats"),
    ("Bram", "Holm", "a lame pony"),
    ("Cora", "Fair Isle", "three hens"),
    ("Dunstan", "Muck", "an old dog"),
    ("Elin", "Rona", "a pair of geese"),
    ("Finn", "Eigg", "seven sheep"),
    ("Greta", "Canna", "one cow"),
    ("Hugh", "Barra", "a cat"),
]


def da_context(i: int) -> str:
    """A short context (about 80 tokens, several chunks at chunk_tokens=16) per index."""
    name, island, animals = FACTS[i % len(FACTS)]
    return (
        f"The lighthouse keeper was named {name}. {name} lived on the island of {island} "
        f"for {20 + i} years.\n\nThe island had one well and {animals}.\n\n"
        f"Supplies came by boat every {2 + i % 5} weeks, weather permitting."
    )


def plain_prompt(i: int) -> str:
    name, island, _ = FACTS[i % len(FACTS)]
    return f"Write one sentence about a keeper called {name} on {island}. ({i})"


def request_body(i: int, *, max_tokens: int = 10, stream: bool = True) -> dict[str, Any]:
    """Request ``i`` of a mixed set: every fourth one runs with DA, the rest are plain."""
    body: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if i % 4 == 0:
        body["messages"] = [{"role": "user", "content": "Who was the keeper, and where?"}]
        body["declarative_attention"] = {"context": da_context(i), "chunk_tokens": 16}
    else:
        body["messages"] = [{"role": "user", "content": plain_prompt(i)}]
    return body


# -- raw connections, for what no HTTP client sends ---------------------------------
def raw_connection(server: RunningServer) -> socket.socket:
    """A plain TCP connection to the server (loopback)."""
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_after(sock: socket.socket, pieces: list[bytes], every_s: float,
                 bound_s: float) -> tuple[float, bytes]:
    """Send ``pieces`` one every ``every_s`` seconds (the first at once) until the server
    closes the connection; ``(seconds until closed, bytes it answered)``, or an
    ``AssertionError`` if it is still open after ``bound_s``."""
    start = time.monotonic()
    answer = b""
    queue = list(pieces)
    next_send = start
    sock.settimeout(0.05)
    while time.monotonic() - start < bound_s:
        if queue and time.monotonic() >= next_send:
            try:
                sock.sendall(queue.pop(0))
            except OSError:  # reset or broken pipe: closed
                return time.monotonic() - start, answer
            next_send += every_s
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start, answer
        if not data:
            return time.monotonic() - start, answer
        answer += data
    raise AssertionError(f"still open after {bound_s} s (answered {answer[:200]!r})")
