"""Response bodies and stream chunks in OpenAI's shapes, for chat and text completions.

One ``Shape`` per request knows its id, model and kind, so the handler only says what
happened (text, a finish, usage) and the shape writes it the way OpenAI does:
``chat.completion`` / ``chat.completion.chunk`` with ``message`` / ``delta``, or
``text_completion`` with ``text``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Shape:
    """How one request's output is written: ``kind`` is ``"chat"`` or ``"text"``."""

    kind: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, kind: str, model: str) -> Shape:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}")

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses -------------------------------------------------------------
    def response(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, Any],
        declarations: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if declarations is not None:
                message["declarations"] = declarations
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    # -- stream chunks ---------------------------------------------------------------
    def first_chunk(self) -> str | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if self.kind != "chat":
            return None
        return self.chunk({"role": "assistant", "content": ""})

    def chunk(
        self,
        delta: dict[str, Any] | str,
        finish_reason: str | None = None,
    ) -> str:
        """A chat ``delta`` dict, or the text of a text-completion chunk."""
        if self.kind == "chat":
            assert isinstance(delta, dict)
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return sse({**self._head("chat.completion.chunk"), "choices": [choice]})
        text = delta if isinstance(delta, str) else delta.get("content", "")
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return sse({**self._head("text_completion"), "choices": [choice]})

    def text_chunk(self, text: str) -> str:
        return self.chunk({"content": text} if self.kind == "chat" else text)

    def finish_chunk(
        self, finish_reason: str, declarations: list[dict[str, Any]] | None = None
    ) -> str:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if declarations is not None:
                delta["declarations"] = declarations
            return self.chunk(delta, finish_reason)
        return self.chunk("", finish_reason)

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """OpenAI's ``include_usage`` chunk: no choices, the request's usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage})
