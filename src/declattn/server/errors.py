"""Errors in the shape OpenAI clients expect: ``{"error": {message, type, param, code}}``.

Clients (the official ``openai`` package among them) read the status and this body to
raise the right exception, so every failure the server reports, including FastAPI's
own validation errors and anything unexpected, goes out in this one shape.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("declattn.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

ECHO_CHARS = 200
"""How much of a client's value an error message repeats (a 10 MB ``model`` is named by
its first characters and its length)."""
ECHO_MESSAGE_CHARS = 1000
"""The same for a whole message that may quote a client (a validation or template error)."""
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(text: str) -> str:
    """``text`` with lone surrogates and control characters (tab and newline aside)
    written as ``\\uXXXX``: JSON carries lone surrogates, but UTF-8 cannot encode them,
    so a message holding one would fail to render (a 500 in place of the real error)."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value as an error message may quote it: escaped, and cut to ``limit``
    characters with the full length named."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return _escape(text)


@dataclass
class APIError(Exception):
    """A failure to report to the client, with its HTTP status."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the one place every error passes: whatever a message quotes, it can render
        self.message = _escape(self.message)
        if self.param is not None:
            self.param = _escape(self.param)
        super().__init__(self.message)
        if self.type is None:
            self.type = _TYPES.get(self.status, "server_error" if self.status >= 500 else
                                   "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has begun."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def _is_union_tag(part: Any) -> bool:
    """Whether a location part names a member of a union (pydantic puts ``"str"`` or
    ``"list[str]"`` in the location of an error inside ``str | list[str]``), not a field."""
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``; union members'
    tags are left out (``("body", "stop", "list[str]")`` -> ``"stop"``)."""
    parts = [p for p in loc if p != "body" and not _is_union_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    # Within a union, the member of the right type says what is wrong with the value
    # (a list of five stop strings is too long; that it is not a string says nothing).
    field = tuple(errors[0].get("loc", ()))[:2]
    first = next((e for e in errors if tuple(e.get("loc", ()))[:2] == field
                  and not str(e.get("type", "")).endswith("_type")), errors[0])
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = echo(ctx.get("error", "malformed JSON"), ECHO_MESSAGE_CHARS)
        return bad_request(f"the request body is not valid JSON ({detail})", code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",):
        if first.get("type") == "missing":
            return bad_request("the request body is missing (a JSON object is required)")
        return bad_request(
            "the request body must be a JSON object (sent as Content-Type: application/json)",
            code="invalid_json",
        )
    param = _loc_to_param(first.get("loc", ()))
    param = None if param is None else echo(param)  # it may hold a client's key
    msg = echo(first.get("msg", "invalid value"), ECHO_MESSAGE_CHARS)
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{msg}{more}", param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every error the app can raise through the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, echo(exc.detail, ECHO_MESSAGE_CHARS), code=code)
        err.headers = dict(exc.headers or {})
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request", exc_info=exc)
        detail = echo(exc, ECHO_MESSAGE_CHARS)
        return APIError(500, f"internal error: {type(exc).__name__}: {detail}").response()
