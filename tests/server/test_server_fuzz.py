"""Schemathesis fuzzes the server's own OpenAPI document: no request may get a 5xx.

The real server with the real model answers; ``--max-tokens-cap 2`` keeps the requests
that reach the engine cheap. Half of the generated bodies get the served model's name,
so valid-looking requests run through prefill and decode rather than stopping at 404.

The schema's own strategies write well-formed strings; a hostile client does not. So
every string in a generated body (values and keys) may be swapped for a lone surrogate,
control characters or a huge value, and every request gets hostile headers (a wrong key,
a foreign ``Host``, kilobytes of junk). The server runs with an API key and an allowed
host, and a stable half of the cases carry the right ones, so the nasty strings reach
the routes, the preparation and the engine, not only the gate.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from conftest import MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from declattn.server.metrics import parse

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = int(os.environ.get("DECLATTN_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = "DECLATTN_FUZZ_EXAMPLES" not in os.environ
"""By default the same 25 examples per operation and mode every run (a stable suite);
set ``DECLATTN_FUZZ_EXAMPLES=N`` for a longer, randomised hunt."""
KEY = "fuzz-key"
HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 256 * 1024

NASTY_TEXT = st.one_of(
    st.sampled_from(["\ud800", "x\udc00", "\udfff\ud800", "\x00", "\x1b[31m", "\u0085",
                     "\r\n", "\ufeff", "<|im_start|>", "</s>"]),
    st.text(st.characters(categories=["Cs", "Cc", "Cf"]), min_size=1, max_size=8),
    st.builds(lambda piece, n: piece * n, st.sampled_from(["a", "\ud800", "é ", "\x00"]),
              st.sampled_from([5_000, 100_000])),  # big; over the body limit once escaped
)
"""Lone surrogates, control and format characters, tags, and huge values."""

HEADER_VALUE = st.one_of(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
            min_size=1, max_size=40),
    st.sampled_from(["Bearer", "bearer " + KEY + "x", "Bearer  " + KEY, "Basic Zm9vOmJhcg==",
                     "[::1]:1", "evil.example:80", "*", "127.0.0.1:0"]),
    st.builds(lambda n: "h" * n, st.sampled_from([4_000, 20_000])),  # over h11's 16 KiB
)
"""What a client can put in a header value (h11, on the client's side too, refuses control
characters and whitespace at either end)."""
HEADER_NAMES = ["Authorization", "Host", "Content-Type", "Accept", "User-Agent",
                "X-Request-Id", "OpenAI-Organization", "Transfer-Encoding-Junk"]


def _nasty(value: Any) -> st.SearchStrategy[Any]:
    """``value`` with any of its strings (values and keys) perhaps replaced."""
    if isinstance(value, str):
        return st.one_of(st.just(value), NASTY_TEXT)
    if isinstance(value, list):
        return st.tuples(*map(_nasty, value)).map(list)
    if isinstance(value, dict):
        items = st.tuples(*(st.tuples(st.one_of(st.just(k), NASTY_TEXT), _nasty(v))
                            for k, v in value.items()))
        return items.map(dict)
    return st.just(value)


def _headers(good: bool) -> st.SearchStrategy[dict[str, str]]:
    """The right key and host (``good``), or hostile values in any of the headers."""
    base = {"Authorization": f"Bearer {KEY}", "Host": HOST}
    junk = st.dictionaries(st.sampled_from(HEADER_NAMES), HEADER_VALUE, max_size=3)
    if good:  # hostile headers beside the right key and host
        junk = junk.map(lambda h: {k: v for k, v in h.items() if k not in base})
    return junk.map(lambda h: {**base, **h})


@pytest.fixture(scope="module")
def fuzz_server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=256, max_tokens_cap=2, max_queue=64, api_key=KEY,
                          allowed_hosts=(HOST,), max_request_bytes=MAX_REQUEST_BYTES)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Any) -> Any:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json",
                                           headers={"Authorization": f"Bearer {KEY}"})

    @schema.hook
    def map_body(context: Any, body: Any) -> Any:
        # a stable half (by the generated name's length) asks for the served model
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            if len(body["model"]) % 2 == 0:
                body = {**body, "model": MODEL}
        return body

    return schema


def _check(case: Any, data: st.DataObject, url: str) -> None:
    """Send ``case`` with nasty strings drawn into its body and headers. httpx sends it,
    not schemathesis, whose own checks of a case cannot encode a lone surrogate."""
    body = case.body
    good = len(repr(body)) % 2 == 0  # a stable half is let in
    drawn = data.draw(_headers(good), label="headers")
    headers = {**(case.headers or {}), **{k: v.encode("latin-1") for k, v in drawn.items()}}
    content = None
    if isinstance(body, bytes):  # the negative mode's other media types
        content = body
    elif body is not schemathesis.core.NOT_SET:
        body = data.draw(_nasty(body), label="body")
        content = json.dumps(body).encode()  # ASCII: a surrogate is sent as \ud800
        headers.setdefault("Content-Type", "application/json")
    response = httpx.request(case.method, url + case.formatted_path, params=case.query or None,
                             headers=headers, content=content, timeout=120)
    where = f"{case.method} {case.formatted_path}"
    assert response.status_code < 500, f"{where}: {response.text[:500]}"
    if response.status_code >= 400 and case.path.startswith("/v1/"):
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(api_schema: Any, fuzz_server: Any, mode: str) -> None:
    """Every operation, ``MAX_EXAMPLES`` generated requests each (schemathesis's pytest
    plugin is driven by hand: its lazy fixture loader does not run under pytest 9)."""
    before = parse(httpx.get(fuzz_server.url + "/metrics").text)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= paths
    for op in operations:
        strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy, data=st.data())
        def run(case: Any, data: st.DataObject) -> None:
            _check(case, data, fuzz_server.url)

        try:
            run()
        except Unsatisfiable:
            # the GETs take no body and at most one free string: nothing is invalid
            assert mode == "negative" and op.method == "get"
    after = parse(httpx.get(fuzz_server.url + "/metrics").text)
    admitted = "declattn_requests_admitted_total"
    if mode == "positive":  # the fuzzing reached the engine, not only the validation
        assert after[admitted] > before[admitted]
    assert after["declattn_kv_blocks_in_use"] == 0
    statuses = {k for k, v in after.items() if k.startswith("declattn_requests_total") and v}
    assert not any('status="5' in k for k in statuses), statuses
