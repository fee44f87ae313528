"""A small client for ``declattn serve``: one call, one DA answer with its figures.

Any OpenAI client can talk to the server; this one exists so that a DA request is one
line (``Client(url).answer(context, question)``) and the answer, the declarations and
the attended-token figures come back as plain Python values rather than nested JSON.
It imports httpx only: no torch, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from declattn.da.accounting import saving

DA_KEYS = frozenset(
    {"chunk_tokens", "chunk_cap", "constrain", "line_start", "masking", "return_tags",
     "min_context"}
)
"""Options that go into the request's ``declarative_attention`` object."""
REQUEST_KEYS = frozenset(
    {"max_tokens", "temperature", "top_p", "seed", "stop", "max_completion_tokens"}
)
"""Options that go into the request body itself."""


class ServerError(Exception):
    """The server answered with an error; ``status``, ``type`` and ``code`` as it sent them."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param


@dataclass
class ClientAnswer:
    """One DA response.

    ``answer``: the text of the ``<answer>`` block (None if the model wrote none);
    ``text``: the whole response content; ``usage``: the server's usage object
    (``attended_tokens``, ``vanilla_attended_tokens`` and the ``declarative_attention``
    report included); ``declarations``: every tag the model wrote, accepted or declined.
    """

    answer: str | None
    text: str
    usage: dict[str, Any]
    declarations: list[dict[str, Any]]
    finish_reason: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def saving(self) -> float:
        """Fraction of full attention's KV reads the response avoided."""
        van = self.usage.get("vanilla_attended_tokens") or 0
        return saving(self.usage.get("attended_tokens", 0), van)


class Client:
    """A connection to one ``declattn serve`` (or any server speaking its DA extension)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 timeout: float = 600.0, api_key: str | None = None) -> None:
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base, timeout=timeout, headers=headers)
        self._model = model

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- calls ----------------------------------------------------------------------
    def models(self) -> list[str]:
        return [m["id"] for m in self._get("/v1/models")["data"]]

    def health(self) -> dict[str, Any]:
        return self._get("/health")

    @property
    def model(self) -> str:
        """The model named in requests: the one given, else the server's first."""
        if self._model is None:
            names = self.models()
            if not names:
                raise ServerError(404, "the server lists no models")
            self._model = names[0]
        return self._model

    def answer(self, context: str | list[str], question: str, **options: Any) -> ClientAnswer:
        """Ask ``question`` over ``context`` (a string, or a list of documents) with DA.

        ``options``: DA options (``chunk_tokens``, ``chunk_cap``, ``constrain``,
        ``line_start``, ``masking``, ``return_tags``, ``min_context``: 0 runs DA whatever the
        gate expects) and request options (``max_tokens``,
        ``temperature`` (default 0, greedy), ``top_p``, ``seed``, ``stop``).
        """
        unknown = set(options) - DA_KEYS - REQUEST_KEYS
        if unknown:
            raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
        da: dict[str, Any] = {k: v for k, v in options.items() if k in DA_KEYS}
        if isinstance(context, str):
            da["context"] = context
        else:
            da["documents"] = list(context)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0.0,
            **{k: v for k, v in options.items() if k in REQUEST_KEYS},
            "declarative_attention": da,
        }
        data = self._post("/v1/chat/completions", body)
        choice = data["choices"][0]
        message = choice["message"]
        usage = data.get("usage") or {}
        report = usage.get("declarative_attention") or {}
        return ClientAnswer(
            answer=report.get("answer"),
            text=message.get("content") or "",
            usage=usage,
            declarations=list(message.get("declarations") or report.get("declarations") or []),
            finish_reason=choice.get("finish_reason"),
            raw=data,
        )

    # -- transport ------------------------------------------------------------------
    def _get(self, path: str) -> Any:
        return self._check(self._http.get(path))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._check(self._http.post(path, json=body))

    @staticmethod
    def _check(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                err = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                raise ServerError(response.status_code, response.text) from None
            raise ServerError(response.status_code, err.get("message", ""), err.get("type"),
                              err.get("code"), err.get("param"))
        return response.json()
