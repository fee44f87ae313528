"""An optional LLM judge, through any OpenAI-compatible ``/chat/completions`` endpoint.

String match misses right answers in other words ("13 years" for "thirteen"); a judge
model can credit them. It is off unless asked for, its identity (endpoint and model) is
written into every row it judged, and its verdict sits beside the string-match score,
never in place of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = """You grade answers to questions about a long document.
Question: {question}
Reference answer(s): {answers}
Candidate answer: {prediction}
Does the candidate give the reference answer (all of it, when there are several), in any \
wording? Reply with one word: YES or NO."""


@dataclass(frozen=True)
class Judge:
    """``base_url`` like ``http://localhost:8000/v1``; ``api_key`` is sent as a bearer token."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 60.0
    transport: httpx.BaseTransport | None = None

    def identity(self) -> dict[str, str]:
        return {"base_url": self.base_url, "model": self.model}

    def __call__(
        self, question: str, answers: Sequence[str], prediction: str | None
    ) -> dict[str, Any]:
        """``{"verdict": bool, "reply": str, "judge": identity}``; no answer is a NO
        without asking."""
        if prediction is None or not prediction.strip():
            return {"verdict": False, "reply": "", "judge": self.identity()}
        body = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": PROMPT.format(
                        question=question, answers=" | ".join(answers), prediction=prediction
                    ),
                }
            ],
        }
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=self.timeout, transport=self.transport) as client:
            r = client.post(
                f"{self.base_url.rstrip('/')}/chat/completions", json=body, headers=headers
            )
            r.raise_for_status()
            reply = r.json()["choices"][0]["message"]["content"] or ""
        return {
            "verdict": reply.strip().upper().startswith("YES"),
            "reply": reply,
            "judge": self.identity(),
        }
