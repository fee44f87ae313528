"""Slow clients are cut off: a connection whose request headers are late is closed.

Loopback only, each test bounded: the server's header deadline is 2 s here (10 s by
default), and every check fails if the connection is still open 2.5 s after it.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import closed_after, raw_connection

HEADER_S = 2.0
SLACK_S = 2.5


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=64, header_timeout_s=HEADER_S)


def test_an_idle_connection_is_closed(server: Any) -> None:
    with raw_connection(server) as sock:
        took, answer = closed_after(sock, [], 1.0, HEADER_S + SLACK_S)
    assert took >= HEADER_S - 0.2 and answer == b""


@pytest.mark.parametrize("every_s", [1.0, 4.0])
def test_headers_sent_a_line_at_a_time_are_cut_off(server: Any, every_s: float) -> None:
    """A line every second (inside any per-read timeout) or every 4 s: the deadline is
    for the whole header block, so both are closed at ``HEADER_S``."""
    lines = [b"POST /v1/chat/completions HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"]
    lines += [b"X-Slow-%d: yes\r\n" % i for i in range(20)]
    with raw_connection(server) as sock:
        took, _ = closed_after(sock, lines, every_s, HEADER_S + SLACK_S)
    assert took >= HEADER_S - 0.2


def test_the_deadline_starts_again_after_each_response(server: Any) -> None:
    """A kept-alive connection gets the same deadline for its next request's headers."""
    get = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with raw_connection(server) as sock:
        sock.sendall(get)
        first = b""
        while not first.endswith(b"}"):  # the whole response: headers, then the JSON body
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        lines = [b"GET /health HTTP/1.1\r\n"] + [b"X-Slow-%d: yes\r\n" % i for i in range(20)]
        _, answer = closed_after(sock, lines, 0.5, HEADER_S + SLACK_S)
    assert answer == b""


def test_a_prompt_client_is_not_hurried(server: Any) -> None:
    """Headers that arrive in time, then a request that takes longer than the deadline
    to answer: the deadline covers the headers only."""
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(HEADER_S / 2)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing yet: the headers are not complete
        sock.sendall(b"\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_malformed_headers_get_an_openai_error(server: Any) -> None:
    with raw_connection(server) as sock:
        huge = b"X-Big: " + b"h" * 20_000 + b"\r\n"
        _, answer = closed_after(sock, [b"GET /v1/models HTTP/1.1\r\n" + huge], 1.0, 5.0)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b'"code":"invalid_http"' in body.replace(b" ", b"")


@pytest.mark.parametrize("header_bytes", [17_000, 40_000])
def test_headers_over_16_kib_sent_whole_are_refused(server: Any, header_bytes: int) -> None:
    """A complete head over 16 KiB in one write: h11 parses it at once (its own bound is
    only on an incomplete head), so the size is checked on the parsed request."""
    request = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
               + b"h" * header_bytes + b"\r\n\r\n")
    with raw_connection(server) as sock:
        _, answer = closed_after(sock, [request], 1.0, 5.0)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b'"code":"invalid_http"' in body.replace(b" ", b"")


def test_headers_under_16_kib_are_served(server: Any) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"h" * 15_000 + b"\r\n\r\n"
    with raw_connection(server) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
