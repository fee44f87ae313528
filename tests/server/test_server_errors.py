"""Errors in OpenAI's shape with the right status, and failures that stay contained."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context

from declattn.api.session import PlainSession
from declattn.server.metrics import parse

openai = pytest.importorskip("openai")

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=128)


@pytest.fixture(scope="module")
def http(server: Any) -> Any:
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def _chat(http: Any, **body: Any) -> httpx.Response:
    return http.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2, **body})


def test_invalid_json_and_wrong_shapes(http: Any) -> None:
    r = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={
        "content-type": "application/json"})
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert _error(http.post(CHAT, content=b"hello"), 400)["code"] == "invalid_json"
    assert _error(http.post(CHAT, json=[1, 2]), 400)["code"] == "invalid_json"
    assert _error(_chat(http, messages="hi"), 400)["param"] == "messages"
    assert _error(_chat(http, temperature="hot"), 400)["param"] == "temperature"
    assert _error(_chat(http, max_tokens=0), 400)["param"] == "max_tokens"
    assert _error(_chat(http, messages=[{"role": "wizard", "content": "x"}]), 400)["param"] == (
        "messages[0].role"
    )
    missing = http.post(CHAT, json={"model": MODEL})
    assert _error(missing, 400)["param"] == "messages"


def test_unknown_model_and_route(http: Any) -> None:
    err = _error(_chat(http, model="gpt-17"), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    assert _error(http.get("/v1/models/gpt-17"), 404)["code"] == "model_not_found"
    assert _error(http.get("/v1/nothing-here"), 404)["type"] == "invalid_request_error"
    completion = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert _error(completion, 404)["param"] == "model"


def test_request_values_the_server_refuses(http: Any) -> None:
    assert _error(_chat(http, messages=[]), 400)["param"] == "messages"
    err = _error(_chat(http, n=2), 400)
    assert err["param"] == "n" and "n=1" in err["message"]
    assert _error(_chat(http, stop=[""]), 400)["param"] == "stop"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert "image_url" in _error(_chat(http, messages=image), 400)["message"]
    surrogate = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % (
        MODEL.encode())
    r = http.post(CHAT, content=surrogate, headers={"content-type": "application/json"})
    assert _error(r, 400)["code"] == "invalid_unicode"
    assert _error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}),
                  400)["param"] == "prompt"


def test_context_longer_than_the_model_allows(http: Any) -> None:
    long = "lighthouse " * 9000
    err = _error(_chat(http, messages=[{"role": "user", "content": long}]), 400)
    assert err["code"] == "context_length_exceeded"
    assert "8192" in err["message"] and "in the prompt" in err["message"]
    err = _error(_chat(http, max_tokens=100_000), 400)
    assert err["code"] == "context_length_exceeded" and "100000 in the completion" in (
        err["message"])
    # fits the model but not this server's 128-block pool
    err = _error(_chat(http, max_tokens=4000), 400)
    assert "KV pool" in err["message"] and "128 blocks" in err["message"]


@pytest.mark.parametrize(
    ("da", "param"),
    [
        ({"context": "x", "documents": ["y"]}, "declarative_attention"),
        ({"chunk_tokens": 16}, "declarative_attention"),
        ({"context": "x", "chunk_size": 16}, "declarative_attention.chunk_size"),
        ({"context": "x", "chunk_tokens": 64, "chunk_cap": 32}, "declarative_attention.chunk_cap"),
        ({"context": "x", "chunk_tokens": 0}, "declarative_attention.chunk_tokens"),
        ({"context": "   "}, "declarative_attention.context"),
        ({"documents": []}, "declarative_attention.documents"),
        ({"context": "x", "return_tags": "hide"}, "declarative_attention.return_tags"),
    ],
)
def test_bad_da_options(http: Any, da: dict[str, Any], param: str) -> None:
    err = _error(_chat(http, declarative_attention=da), 400)
    assert err["param"] == param, err


def test_da_needs_a_question(http: Any) -> None:
    da = {"context": da_context(0), "chunk_tokens": 16}
    only_system = [{"role": "system", "content": "Be brief."}]
    assert "user message" in _error(_chat(http, messages=only_system,
                                           declarative_attention=da), 400)["message"]
    blank = [{"role": "user", "content": "  "}]
    assert "empty" in _error(_chat(http, messages=blank, declarative_attention=da),
                             400)["message"]


def _blocks_in_use(http: Any) -> float:
    return parse(http.get("/metrics").text)["declattn_kv_blocks_in_use"]


def test_engine_failure_fails_the_request_not_the_server(
    server: Any, http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.state.engine
    real_step = engine.step
    calls = {"n": 0}

    def broken_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step, after the prefill
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(engine, "step", broken_step)
    failed0 = parse(http.get("/metrics").text)["declattn_requests_failed_total"]
    err = _error(_chat(http, max_tokens=6), 500)
    assert err["type"] == "server_error" and "simulated kernel failure" in err["message"]
    assert _blocks_in_use(http) == 0
    assert parse(http.get("/metrics").text)["declattn_requests_failed_total"] == failed0 + 1
    assert _chat(http, max_tokens=3).status_code == 200  # the loop is still stepping
    assert http.get("/health").json()["status"] == "ok"


def test_a_broken_request_fails_alone(
    server: Any, http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = PlainSession.on_token

    def on_token(self: PlainSession, token_id: int, text: str) -> str | None:
        reason = real(self, token_id, text)
        if "boom" in self.prompt_text and self.accounting.steps >= 2:
            raise ValueError("controller exploded")  # on the third token
        return reason

    monkeypatch.setattr(PlainSession, "prompt_text", "", raising=False)
    monkeypatch.setattr(PlainSession, "on_token", on_token)
    tok = server.state.engine.tokenizer
    real_init = PlainSession.__init__

    def init(self: PlainSession, prompt_ids: list[int], block_size: int) -> None:
        real_init(self, prompt_ids, block_size)
        self.prompt_text = tok.decode(prompt_ids)

    monkeypatch.setattr(PlainSession, "__init__", init)
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    err = _error(_chat(http, messages=[{"role": "user", "content": "boom"}], max_tokens=6), 500)
    assert "controller exploded" in err["message"]
    # streamed: the failure comes after the response began, as an error event
    seen = []
    with pytest.raises(openai.APIError, match="controller exploded") as info:
        for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "boom"}], max_tokens=6,
            stream=True,
        ):
            seen.append(chunk)
    assert not isinstance(info.value, openai.APIStatusError)  # an event, not a status
    assert seen and seen[0].choices[0].delta.role == "assistant"
    assert _blocks_in_use(http) == 0
    ok = _chat(http, messages=[{"role": "user", "content": "fine"}])
    assert ok.status_code == 200


# -- any string a client sends can be named in an error -----------------------------
def _raw(http: Any, path: str, body: str) -> httpx.Response:
    """``body`` sent as written: JSON escapes such as ``\\ud800`` reach the server as is."""
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


NASTY = [
    "\\ud800",  # a lone high surrogate: UTF-8 cannot encode it
    "x\\udc00",  # a lone low one after text
    "\\u0000\\u001b[31m\\u0085\\r",  # NUL, an ANSI escape, a C1 control, a carriage return
]


@pytest.mark.parametrize("value", NASTY)
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_unknown_model_named_safely(http: Any, path: str, value: str) -> None:
    rest = ('"messages": [{"role": "user", "content": "hi"}]' if path == CHAT
            else '"prompt": "hi"')
    err = _error(_raw(http, path, f'{{"model": "{value}", {rest}, "max_tokens": 2}}'), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    # named, escaped as JSON would write it
    assert value.replace("\\r", "\\u000d").lstrip("x") in err["message"]


def test_huge_values_are_cut_when_named(http: Any) -> None:
    err = _error(_chat(http, model="m" * 3_000_000), 404)
    assert len(err["message"]) < 400 and "3000000 characters" in err["message"]
    key = "k" * 100_000  # an unknown option's name becomes the error's param
    err = _error(_chat(http, declarative_attention={"context": "a", key: 1}), 400)
    assert len(err["message"]) < 1500 and len(err["param"]) < 300
    err = _error(_chat(http, messages=[{"role": "user", "content": [{"type": "t" * 10**6}]}]),
                 400)
    assert len(err["message"]) < 400 and "not supported" in err["message"]


@pytest.mark.parametrize("value", NASTY)
def test_validation_errors_name_client_keys_safely(http: Any, value: str) -> None:
    body = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'"declarative_attention": {{"context": "a", "{value}": 1}}}}')
    err = _error(_raw(http, CHAT, body), 400)
    assert err["param"].startswith("declarative_attention")
    bad_role = (f'{{"model": "{MODEL}", "messages": [{{"role": "{value}", "content": "hi"}}]}}')
    assert _error(_raw(http, CHAT, bad_role), 400)["param"] == "messages[0].role"
    part = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
            f'[{{"type": "{value}"}}]}}]}}')
    assert "not supported" in _error(_raw(http, CHAT, part), 400)["message"]


def test_a_stop_string_of_any_length(http: Any) -> None:
    """The four-item bound is on the list of stop strings, not on a single one's length."""
    assert _chat(http, stop="\n\nUser:").status_code == 200
    assert _chat(http, stop=["\n\nUser:", "x" * 100]).status_code == 200
    assert _error(_chat(http, stop=["a", "b", "c", "d", "e"]), 400)["param"] == "stop"


def test_the_schema_bounds_the_stop_list_not_a_string(http: Any) -> None:
    """What the fuzzer reads: a string of any length, or a list of at most four."""
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    stop = schema["ChatCompletionRequest"]["properties"]["stop"]
    kinds = {branch.get("type"): branch for branch in stop["anyOf"]}
    assert "maxLength" not in kinds["string"] and kinds["array"]["maxItems"] == 4


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def _raw_chat(http: Any, body: dict[str, Any]) -> httpx.Response:
    """``body`` sent as ASCII JSON, where ``"\\ud800"`` stays a lone surrogate escape."""
    import json

    content = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
    return http.post(CHAT, content=content, headers={"content-type": "application/json"})


def _surrogate_cases() -> list[tuple[dict[str, Any], str]]:
    bad_call = {**CALL, "function": {"name": "lookup", "arguments": '{"q": "\ud800"}'}}
    bad_tool = {"type": "function", "function": {**TOOL["function"], "description": "\udfff"}}
    asked = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    answered = {"role": "tool", "tool_call_id": "c1", "content": "a word"}
    return [
        ({"messages": [{"role": "user", "content": "Hi", "name": "x\ud800"}]},
         "messages[0].name"),
        ({"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "", "tool_calls": [bad_call]},
                       answered, {"role": "user", "content": "So?"}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "user", "content": "Hi"}, asked,
                       {**answered, "tool_call_id": "\udc00"}, {"role": "user", "content": "So?"}]},
         "messages[2].tool_call_id"),
        ({"messages": USER, "tools": [bad_tool]}, "tools[0].function.description"),
    ]


@pytest.mark.parametrize("chunks", [None, "messages"])
@pytest.mark.parametrize("case", range(4))
def test_lone_surrogates_anywhere_in_a_chat_are_named(
    http: Any, case: int, chunks: str | None
) -> None:
    """A name, a tool call or a tool definition holding a lone surrogate is a 400 naming
    the field, plain or with the conversation as DA's context (where it once came back
    as a codec error inside an ``invalid_da_options`` 400)."""
    body, param = _surrogate_cases()[case]
    if chunks is not None:
        body = {**body, "declarative_attention": {"chunks": chunks}}
    err = _error(_raw_chat(http, body), 400)
    assert err["code"] == "invalid_unicode" and err["param"] == param, err
