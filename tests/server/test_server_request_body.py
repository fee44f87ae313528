"""Request bodies: a size limit held before parsing, and a deadline for slow senders.

Loopback only; the server here takes at most 1 MiB and 3 s (+1 s per 64 KiB received)
for a body, and every slow-sender check fails if the connection is still open 2.5 s
after its deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import MODEL, closed_after, raw_connection

from declattn.server.request_body import DEFAULT_MAX_REQUEST_BYTES, MIN_BODY_RATE

LIMIT = 1024 * 1024
BODY_S = 3.0
SLACK_S = 2.5
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=64, max_request_bytes=LIMIT, body_timeout_s=BODY_S)


def _body(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes."""
    head = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    empty = len(json.dumps(head).encode())
    head["messages"][0]["content"] = "x" * (size - empty)
    out = json.dumps(head).encode()
    assert len(out) == size
    return out


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server: Any) -> None:
    """Only the headers are sent: the 413 comes without waiting for a byte of the body."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * 1024 * 1024}\r\n\r\n").encode()
    with raw_connection(server) as sock:
        took, answer = closed_after(sock, [head], 1.0, BODY_S)
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 ") and took < BODY_S
    err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert str(50 * 1024 * 1024) in err["message"]


def test_a_streamed_body_is_cut_off_once_past_the_limit(server: Any) -> None:
    """No Content-Length (chunked): refused once the bytes read pass the limit, not
    after the whole 8 MiB."""
    sent = {"bytes": 0}

    def chunks() -> Iterator[bytes]:
        for _ in range(128):
            sent["bytes"] += 64 * 1024
            yield b"x" * (64 * 1024)

    try:
        r = httpx.post(server.url + CHAT, content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
    except httpx.TransportError:  # closed while we were still sending: also a refusal
        assert sent["bytes"] < 8 * 1024 * 1024
        return
    err = _error(r, 413)
    assert "passed" in err["message"] and str(LIMIT) in err["message"]


def test_a_body_at_the_limit_is_served(server: Any) -> None:
    r = httpx.post(server.url + CHAT, content=_body(LIMIT), timeout=120,
                   headers={"content-type": "application/json"})
    # read in full and parsed: refused for its tokens, not its bytes
    assert _error(r, 400)["code"] == "context_length_exceeded"
    small = httpx.post(server.url + CHAT, content=_body(200), timeout=120,
                       headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text


@pytest.mark.parametrize("every_s", [0.5, 2.0])
def test_a_body_sent_a_byte_at_a_time_times_out(server: Any, every_s: float) -> None:
    body = _body(300)
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    pieces = [head] + [body[i:i + 1] for i in range(len(body))]
    with raw_connection(server) as sock:
        took, answer = closed_after(sock, pieces, every_s, BODY_S + SLACK_S)
    assert took >= BODY_S - 0.2
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


def test_a_large_body_on_a_slow_steady_link_gets_through(server: Any) -> None:
    """800 KB at about 200 KB/s takes 4 s, past the 3 s base deadline, but every 64 KiB
    received extends it by a second."""
    body = _body(800_000)
    step = 40_000
    assert len(body) / (step / 0.2) > BODY_S and 200_000 > MIN_BODY_RATE

    def slowly() -> Iterator[bytes]:
        for i in range(0, len(body), step):
            time.sleep(0.2)
            yield body[i:i + step]

    r = httpx.post(server.url + CHAT, content=slowly(), timeout=60,
                   headers={"content-type": "application/json", "content-length": str(len(body))})
    assert _error(r, 400)["code"] == "context_length_exceeded"  # read in full, then judged


def test_the_default_limit(server_factory: Any) -> None:
    """16 MiB unless configured: 17 MiB declared is refused at once."""
    assert DEFAULT_MAX_REQUEST_BYTES == 16 * 1024 * 1024
    default = server_factory(kv_blocks=16)
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {17 * 1024 * 1024}\r\n\r\n").encode()
    with raw_connection(default) as sock:
        _, answer = closed_after(sock, [head], 1.0, 5.0)
    assert answer.startswith(b"HTTP/1.1 413") and str(16 * 1024 * 1024).encode() in answer
