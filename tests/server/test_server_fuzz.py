"""Schemathesis fuzzes the server's own OpenAPI document: no request may get a 5xx.

The real server with the real model answers; ``--max-tokens-cap 2`` keeps the requests
that reach the engine cheap. Half of the generated bodies get the served model's name,
so valid-looking requests run through prefill and decode rather than stopping at 404.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
from conftest import MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from declattn.server.metrics import parse

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = int(os.environ.get("DECLATTN_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = "DECLATTN_FUZZ_EXAMPLES" not in os.environ
"""By default the same 25 examples per operation and mode every run (a stable suite);
set ``DECLATTN_FUZZ_EXAMPLES=N`` for a longer, randomised hunt."""


@pytest.fixture(scope="module")
def fuzz_server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=256, max_tokens_cap=2, max_queue=64)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Any) -> Any:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")

    @schema.hook
    def map_body(context: Any, body: Any) -> Any:
        # a stable half (by the generated name's length) asks for the served model
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            if len(body["model"]) % 2 == 0:
                body = {**body, "model": MODEL}
        return body

    return schema


def _check(case: Any) -> None:
    response = case.call(timeout=120)
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
        @given(case=strategy)
        def run(case: Any) -> None:
            _check(case)

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
