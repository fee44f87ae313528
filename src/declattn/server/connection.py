"""The HTTP connection under uvicorn: a deadline for the request line and headers.

uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``),
but a fresh connection that sends nothing, or a request's headers one line every few
seconds, are kept open for ever: a client can hold many such connections at no cost.
No ASGI middleware can see them (the app is called only once the headers are in), so
the deadline lives in the protocol: from the moment a connection opens, and again after
each response, the next request's line and headers must arrive within
``header_timeout_s`` or the connection is closed. The body has its own deadline in
``request_body.BodyGuard``.

The protocol is uvicorn's h11 one, used through its public surface (h11's connection
state, uvicorn's ``on_response_complete`` hook); uvicorn itself pins neither.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from declattn.server.errors import APIError

DEFAULT_HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_TIMEOUT_S = 5
"""uvicorn's own default: an idle connection after a response is closed after this."""


MAX_HEAD_BYTES = 16 * 1024
"""The most a request line and its headers may weigh (h11's own default buffer limit)."""

HEAD_TOO_LARGE = f"the request line and headers are over {MAX_HEAD_BYTES // 1024} KiB"


def head_bytes(event: h11.Request) -> int:
    """The bytes of ``event``'s request line and headers as sent, less any whitespace
    h11 dropped (padding around values): a lower bound, so a client under the limit is
    never refused."""
    line = len(event.method) + len(event.target) + len(b"HTTP/") + len(event.http_version) + 4
    fields = sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
    return line + fields + 2


class SizedConnection(h11.Connection):
    """An h11 connection that refuses a request whose line and headers are over
    ``MAX_HEAD_BYTES``.

    Why: h11's ``max_incomplete_event_size`` bounds only what it buffers while a head is
    still incomplete. A head that arrives whole in one read (a 17,000-byte header on a
    fast connection) is parsed at once and never meets the bound, so it was answered
    where docs/server.md promises a 400."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and head_bytes(event) > MAX_HEAD_BYTES:
            raise h11.RemoteProtocolError(HEAD_TOO_LARGE)
        return event


class HeaderDeadlineProtocol(H11Protocol):
    """h11 over asyncio, closing a connection whose request headers are late (or over
    ``MAX_HEAD_BYTES``)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = SizedConnection(h11.SERVER, MAX_HEAD_BYTES)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the app has it
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # waiting for the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (headers over its 16 KiB, a
        malformed line), in OpenAI's error shape like every other error, then close."""
        body = APIError(400, f"{msg} (the request line or headers are malformed or too large)",
                        code="invalid_http").body()
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=data), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn instantiates per connection, with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str = "info",
                   header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> Any:
    """How ``declattn serve`` (and the tests) run ``app`` under uvicorn."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=protocol(header_timeout_s),
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        timeout_graceful_shutdown=5,
    )
