"""Capacity: a full batch queues, a full queue answers 503, and it recovers; a client that
goes away is cancelled and its blocks come back; blocks are taken as a response grows,
so on a small pool a long request cannot make short ones wait for it (it is preempted
and recomputed, and writes what it writes alone); a request past its timeout ends."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import MODEL

from declattn.server.metrics import parse

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # about 16 tokens; the model keeps counting


A_TOKENS = 256
"""Long enough that A still runs while B queues and C is refused, on a loaded machine."""
CUT_TOKENS = 900
"""The request a client leaves mid-stream: with its prompt, most of the 64-block pool, so
it is still decoding when the client (in this process, beside the server's thread) has
read two chunks, however busy the machine (at 256 it once finished first under two test
workers)."""


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    """One request at a time: a second one queues, a third gets 503."""
    return server_factory(kv_blocks=64, max_queue=1, max_batch=1)


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


def test_queue_then_503_then_recovery(http: Any) -> None:
    rejected0 = _metrics(http)["declattn_requests_rejected_total"]
    with http.stream("POST", "/v1/completions", json=_body(A_TOKENS, stream=True)) as a:
        assert a.status_code == 200
        lines = a.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # A is running
        # blocks as the response grows: the prompt's and the tokens written so far
        assert 0 < _metrics(http)["declattn_kv_blocks_in_use"] < 64

        b_result: dict[str, Any] = {}
        b = threading.Thread(target=lambda: b_result.update(
            r=http.post("/v1/completions", json=_body(8))))
        b.start()  # the batch holds one: it waits in the queue
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
    assert b_result["r"].json()["usage"]["completion_tokens"] == 8
    m = _metrics(http)
    assert m["declattn_requests_rejected_total"] == rejected0 + 1
    assert m['declattn_requests_total{endpoint="/v1/completions",status="503"}'] >= 1
    assert m["declattn_kv_blocks_in_use"] == 0 and m["declattn_queue_depth"] == 0
    d = http.post("/v1/completions", json=_body(4))
    assert d.status_code == 200


def test_disconnect_mid_stream_frees_blocks(http: Any) -> None:
    before = _metrics(http)
    with http.stream("POST", "/v1/completions", json=_body(CUT_TOKENS, stream=True)) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break
        assert _metrics(http)["declattn_kv_blocks_in_use"] > 0
    # leaving the block closes the connection mid-stream
    _wait_for(lambda: _metrics(http)["declattn_kv_blocks_in_use"] == 0, "blocks to free")
    after = _metrics(http)
    cancelled = "declattn_requests_cancelled_total"
    assert after[cancelled] == before[cancelled] + 1
    assert after["declattn_running"] == 0
    tokens = "declattn_generated_tokens_total"
    generated = after[tokens] - before[tokens]
    assert generated < CUT_TOKENS  # it stopped; it did not run to max_tokens
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


LONG = 150  # tokens of the long request: with its 23-token prompt, 11 of the small pool's 12
SHORT = 40  # tokens of each short one: with its 8-token prompt, 3 blocks (4 at the last step)
SHORTS = 4  # together, about the whole pool: they fit beside each other, not beside the long


@pytest.fixture(scope="module")
def small(server_factory: Any) -> Any:
    return server_factory(kv_blocks=12, max_batch=16)


def _long_body() -> dict[str, Any]:
    return {**_body(LONG), "stop": None}


def test_a_long_request_does_not_make_short_ones_wait(small: Any) -> None:
    """A long response and a burst of short ones on a pool that cannot hold them all: the
    short ones finish while the long one runs (it gives way and is recomputed), and the
    long one writes exactly what it writes alone (fp32, greedy)."""
    with httpx.Client(base_url=small.url, timeout=900) as c:
        alone = c.post("/v1/completions", json=_long_body()).json()
        finished: dict[str, float] = {}

        def long_run() -> None:
            finished["long_body"] = c.post("/v1/completions", json=_long_body()).json()
            finished["long"] = time.monotonic()

        t = threading.Thread(target=long_run)
        t.start()
        # 5 of its 11 blocks: over 90 tokens still to write when the shorts (40 each) come
        _wait_for(lambda: _metrics(c)["declattn_kv_blocks_in_use"] >= 5, "the long one to grow")

        def short(i: int) -> float:  # 3-4 blocks each: with the long one, too many
            body = {**_body(SHORT), "prompt": f"{i}, {i + 1}, {i + 2},"}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(SHORTS) as pool:
            shorts = list(pool.map(short, range(SHORTS)))
        t.join(900)
        assert max(shorts) < finished["long"]  # none waited for the long one to end
        long = finished["long_body"]
        assert long["choices"][0]["text"] == alone["choices"][0]["text"]
        assert long["usage"]["preemptions"] >= 1  # it gave way, and came back the same
        m = _metrics(c)
        assert m["declattn_preemptions_total"] >= 1 and m["declattn_kv_blocks_in_use"] == 0


UNTIMELY = 340  # tokens asked of a request that has 1.5 s: far more than it can write


def test_a_request_past_its_timeout_ends_with_what_it_wrote(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        r = c.post("/v1/completions", json={**_body(UNTIMELY), "stop": None, "timeout": 1.5})
        assert r.status_code == 200
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["engine_finish_reason"] == "timeout"
        assert 0 < body["usage"]["completion_tokens"] < UNTIMELY
        bad = c.post("/v1/completions", json={**_body(4), "timeout": 0})
        assert bad.status_code == 400
        _wait_for(lambda: _metrics(c)["declattn_kv_blocks_in_use"] == 0, "blocks to free")



def test_a_pool_larger_than_memory_is_refused_before_the_server_starts(
    smol_engine: Any,
) -> None:
    from declattn.cli.common import UserError
    from declattn.cli.serve_cmd import serve
    from declattn.engine.memory import available_bytes
    from declattn.server.app import ServerConfig

    free = available_bytes()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    c = smol_engine.loaded.config
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16  # fp32 at most
    blocks = 4 * free // per_block + 1
    with pytest.raises(UserError, match=r"a KV pool of .* needs .* GiB, more than the .* GiB "
                       r"of memory available: ask for fewer KV blocks"):
        serve(smol_engine, ServerConfig(model_id=MODEL, kv_blocks=blocks), host="127.0.0.1",
              port=1)
