"""Who may talk to the server: an API key, and the host names it answers to.

- ``api_key``: every request must carry ``Authorization: Bearer <key>`` (what the OpenAI
  clients send as their ``api_key``), except on the ``open_paths`` (by default
  ``/health`` and ``/metrics``, for probes and scrapers, as vLLM leaves them); a missing
  or wrong key is a 401 in OpenAI's error shape. The key is compared in constant time
  and never repeated in a response.
- ``allowed_hosts``: the ``Host`` header must name one of them (``*.example.com``
  matches any subdomain, ``*`` anything), which stops a DNS-rebinding page in a browser
  from reaching a server bound to a private address; others get a 400.

Both are checked before the body is read, and a refusal closes the connection so an
unread body is not drained.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.datastructures import Headers

from declattn.server.errors import APIError, echo

DEFAULT_OPEN_PATHS = ("/health", "/metrics")


def host_name(host: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    name = host_name(host)
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def bearer_matches(authorization: str | None, key: bytes) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # header values arrive as latin-1; their bytes are what the client sent
    return hmac.compare_digest(token.strip().encode("latin-1"), key)


class Access:
    """ASGI middleware: see the module's docstring."""

    def __init__(self, app: Any, api_key: str | None = None,
                 open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS,
                 allowed_hosts: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None
        self.open_paths = frozenset(open_paths)
        self.allowed_hosts = allowed_hosts

    def _refusal(self, scope: dict[str, Any]) -> APIError | None:
        headers = Headers(scope=scope)
        if self.allowed_hosts is not None:
            host = headers.get("host", "")
            if not host_allowed(host, self.allowed_hosts):
                return APIError(
                    400, f"the Host header '{echo(host)}' is not one this server answers to "
                    "(--allowed-hosts)", code="invalid_host", headers={"Connection": "close"})
        if self.key is not None and scope.get("path", "") not in self.open_paths:
            if not bearer_matches(headers.get("authorization"), self.key):
                return APIError(
                    401, "a valid API key is required: send it as 'Authorization: Bearer "
                    "<key>' (the api_key of an OpenAI client)", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
