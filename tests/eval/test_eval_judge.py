"""The optional LLM judge: what it sends, how it reads the reply, and who it was."""

from __future__ import annotations

import json

import httpx

from declattn.eval.judge import Judge


def _judge(reply: str, seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            (str(request.url), request.headers.get("authorization"), json.loads(request.content))
        )
        return httpx.Response(200, json={"choices": [{"message": {"content": reply}}]})

    return Judge(
        "http://judge.local/v1/", "grader-7b", "k3y", transport=httpx.MockTransport(handler)
    )


def test_judge_verdict_and_identity():
    seen: list = []
    out = _judge(" Yes.", seen)("How old?", ["13", "thirteen"], "13 years old")
    assert out["verdict"] is True
    assert out["judge"] == {"base_url": "http://judge.local/v1/", "model": "grader-7b"}
    url, auth, body = seen[0]
    assert url == "http://judge.local/v1/chat/completions" and auth == "Bearer k3y"
    assert body["model"] == "grader-7b" and body["temperature"] == 0
    assert "13 | thirteen" in body["messages"][0]["content"]
    assert _judge("NO", [])("q", ["a"], "b")["verdict"] is False


def test_no_answer_is_no_without_a_call():
    seen: list = []
    out = _judge("YES", seen)("q", ["a"], None)
    assert out["verdict"] is False and not seen
