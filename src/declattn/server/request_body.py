"""Each request's body is read in full, under a size limit and a deadline, before the app.

Every route of this API reads a whole JSON body anyway, so the middleware reads it first
and hands it on in one piece. That is where both limits can be held before anything is
parsed:

- size: a ``Content-Length`` over ``max_bytes`` is refused before a byte of the body is
  read, and a body sent without one (chunked) as soon as it passes the limit: 413,
  naming the limit;
- time: the body must arrive within ``timeout_s``, extended by one second for every
  ``min_rate`` bytes received, so a large body on a slow but steady link gets through
  while one byte every few seconds does not: 408.

Either refusal closes the connection, so the rest of an unwanted body is not drained.
The size read is left in ``scope["state"]`` for the preparation pool to weigh.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.datastructures import Headers

from declattn.server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
MIN_BODY_RATE = 64 * 1024
"""Bytes a second that keep extending a body's deadline."""
BODY_BYTES = "declattn.body_bytes"
"""The ``scope["state"]`` key of the body's size."""


def body_bytes(scope: dict[str, Any]) -> int:
    """The size of the body the guard read for this request (0 if none)."""
    return int(scope.get("state", {}).get(BODY_BYTES, 0))


def _declared_length(scope: dict[str, Any]) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # the HTTP layer refuses it before this runs


class BodyGuard:
    """ASGI middleware: see the module's docstring."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 timeout_s: float = DEFAULT_BODY_TIMEOUT_S, min_rate: int = MIN_BODY_RATE) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    def _too_large(self, size: int, declared: bool) -> APIError:
        what = f"is {size} bytes" if declared else f"passed {self.max_bytes} bytes"
        return APIError(
            413,
            f"the request body {what}; this server accepts at most {self.max_bytes} bytes "
            "(--max-request-bytes)",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    def _too_slow(self, size: int) -> APIError:
        return APIError(
            408,
            f"the request body did not arrive in time ({size} bytes in {self.timeout_s:g} s "
            f"and 1 s more per {self.min_rate} bytes; --body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(declared, True).response()(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks: list[bytes] = []
        size = 0
        while True:
            left = start + self.timeout_s + size / self.min_rate - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                await self._too_slow(size).response()(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(size, False).response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        scope.setdefault("state", {})[BODY_BYTES] = size
        await self.app(scope, _Replay(b"".join(chunks), receive), send)


class _Replay:
    """The ASGI ``receive`` the app gets: the whole body first, then the real channel
    (which reports the client's disconnect)."""

    def __init__(self, body: bytes, receive: Any) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()
