"""A small KV pool: admission waits for blocks, a full queue answers 503, and it recovers;
a client that goes away is cancelled and its blocks come back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import MODEL

from declattn.server.metrics import parse

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # about 16 tokens; the model keeps counting


A_TOKENS = 48


@pytest.fixture(scope="module")
def sizes(smol_engine: Any) -> dict[str, int]:
    """Request A takes the pool but 2 blocks; B needs 3, so it must wait for A."""
    prompt = len(smol_engine.tokenizer.encode(PROMPT))
    a_blocks = -(-(prompt + A_TOKENS) // 16)
    return {"a_blocks": a_blocks, "pool": a_blocks + 2, "b_tokens": 3 * 16 - prompt}


@pytest.fixture(scope="module")
def server(server_factory: Any, sizes: dict[str, int]) -> Any:
    return server_factory(kv_blocks=sizes["pool"], max_queue=1, max_batch=4)


@pytest.fixture(scope="module")
def http(server: Any) -> Any:
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def _metrics(http: Any) -> dict[str, float]:
    return parse(http.get("/metrics").text)


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": stream}


def test_queue_then_503_then_recovery(http: Any, sizes: dict[str, int]) -> None:
    rejected0 = _metrics(http)["declattn_requests_rejected_total"]
    with http.stream("POST", "/v1/completions", json=_body(A_TOKENS, stream=True)) as a:
        assert a.status_code == 200
        lines = a.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # A is running
        # prompt + max_tokens reserved at admission
        assert _metrics(http)["declattn_kv_blocks_in_use"] == sizes["a_blocks"]

        b_result: dict[str, Any] = {}
        b = threading.Thread(target=lambda: b_result.update(
            r=http.post("/v1/completions", json=_body(sizes["b_tokens"]))))
        b.start()  # needs 3 blocks, 2 are free: it waits in the queue
        _wait_for(lambda: _metrics(http)["declattn_queue_depth"] == 1, "B to queue")

        c = http.post("/v1/completions", json=_body(4))
        assert c.status_code == 503
        assert c.headers["retry-after"] == "1"
        err = c.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "server_error"
        assert _metrics(http)["declattn_queue_depth"] == 1  # B still waits its turn
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
    b.join(120)
    assert b_result["r"].status_code == 200
    assert b_result["r"].json()["usage"]["completion_tokens"] == sizes["b_tokens"]
    m = _metrics(http)
    assert m["declattn_requests_rejected_total"] == rejected0 + 1
    assert m['declattn_requests_total{endpoint="/v1/completions",status="503"}'] >= 1
    assert m["declattn_kv_blocks_in_use"] == 0 and m["declattn_queue_depth"] == 0
    d = http.post("/v1/completions", json=_body(4))
    assert d.status_code == 200


def test_disconnect_mid_stream_frees_blocks(http: Any, sizes: dict[str, int]) -> None:
    before = _metrics(http)
    with http.stream("POST", "/v1/completions", json=_body(A_TOKENS, stream=True)) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break
        assert _metrics(http)["declattn_kv_blocks_in_use"] == sizes["a_blocks"]
    # leaving the block closes the connection mid-stream
    _wait_for(lambda: _metrics(http)["declattn_kv_blocks_in_use"] == 0, "blocks to free")
    after = _metrics(http)
    cancelled = "declattn_requests_cancelled_total"
    assert after[cancelled] == before[cancelled] + 1
    assert after["declattn_running"] == 0
    tokens = "declattn_generated_tokens_total"
    generated = after[tokens] - before[tokens]
    assert generated < A_TOKENS  # it stopped; it did not run to max_tokens
    assert http.post("/v1/completions", json=_body(4)).status_code == 200


def test_non_streaming_client_that_gives_up_is_cancelled(server: Any, http: Any) -> None:
    before = _metrics(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=_body(A_TOKENS), timeout=1.0)
    _wait_for(lambda: _metrics(http)["declattn_requests_cancelled_total"]
              == before["declattn_requests_cancelled_total"] + 1, "the cancel")
    _wait_for(lambda: _metrics(http)["declattn_kv_blocks_in_use"] == 0, "blocks to free")
    generated = (_metrics(http)["declattn_generated_tokens_total"]
                 - before["declattn_generated_tokens_total"])
    assert generated < A_TOKENS
