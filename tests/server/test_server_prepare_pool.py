"""Preparation runs beside other requests: a big one never holds a small one back.

Loopback, bounded: every request here either finishes in seconds or is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context

from declattn.server.prepare_pool import PreparePool

CHAT = "/v1/chat/completions"
FIVE_MB = 5_000_000


def _text(size: int) -> str:
    return ("The lighthouse keeper was named Ada and lived on Skerry. " * (size // 50 + 1))[:size]


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=128, max_request_bytes=32 * 1024 * 1024)


def _timed(url: str, body: dict[str, Any], out: dict[str, Any], name: str) -> None:
    t0 = time.monotonic()
    r = httpx.post(url + CHAT, json=body, timeout=300)
    out[name] = (r, time.monotonic() - t0, time.monotonic())


@pytest.mark.parametrize("where", ["messages", "context", "prompt"])
def test_a_5mb_prompt_is_refused_before_it_is_tokenised(server: Any, where: str) -> None:
    """Tokenising 5 MB takes 5 to 40 s on this 2-core machine; its character count alone
    shows it cannot fit (SmolLM2 writes at most 81 characters a token), and the refusal
    says so (the exact count's message names the tokens in the prompt instead)."""
    text = _text(FIVE_MB)
    if where == "messages":
        path, body = CHAT, _chat(text)
    elif where == "context":
        path, body = CHAT, _chat("Who was the keeper?", declarative_attention={"context": text})
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2}
    t0 = time.monotonic()
    r = httpx.post(server.url + path, json=body, timeout=300)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert took < 10.0, f"{took:.1f} s"  # loose: the machine is shared


def test_a_prompt_under_the_bound_is_counted_exactly(server: Any) -> None:
    """Under the character bound (81 x 2047 here, the pool's 2048 tokens less one) the
    exact count decides: 100 kB is about 22k tokens."""
    r = httpx.post(server.url + CHAT, json=_chat(_text(100_000)), timeout=300)
    assert r.status_code == 400
    assert "in the prompt" in r.json()["error"]["message"]  # the exact count's message


def test_a_small_request_is_not_held_behind_a_5mb_one(server: Any) -> None:
    """The character bound off, so the 5 MB prompt is really tokenised (seconds); a
    4-token request sent 0.3 s later is answered while that goes on (it shares the two
    cores with the tokenizer, so it is slower than alone, but not by the big one's time)."""
    state = server.state
    bounded = state.limits
    state.limits = dataclasses.replace(bounded, token_bound=None)
    try:
        out: dict[str, Any] = {}
        big = threading.Thread(target=_timed, args=(server.url, _chat(_text(FIVE_MB)), out, "big"))
        big.start()
        time.sleep(0.3)
        _timed(server.url, _chat("Hi"), out, "small")
        big.join(300)
    finally:
        state.limits = bounded
    (big_r, big_s, big_end), (small_r, small_s, small_end) = out["big"], out["small"]
    assert big_r.status_code == 400 and small_r.status_code == 200, small_r.text
    print(f"\n5 MB prompt prepared in {big_s:.2f} s; a small request sent 0.3 s later: "
          f"{small_s:.2f} s")
    assert small_end < big_end and small_s < big_s / 2


def test_big_requests_leave_a_worker_for_small_ones(server_factory: Any) -> None:
    """Two workers, two big requests at once: a small request gets the free worker at once
    and is answered before either big one (that they take turns is held without clocks in
    test_big_calls_take_turns_in_one_worker). The big ones are 5 MB each (seconds of
    tokenising each): at 1.5 MB the small one once finished 0.07 s after them, with a
    second test process on the two cores."""
    srv = server_factory(kv_blocks=64, prepare_workers=2)
    srv.state.limits = dataclasses.replace(srv.state.limits, token_bound=None)
    out: dict[str, Any] = {}
    bigs = [threading.Thread(target=_timed, args=(srv.url, _chat(_text(FIVE_MB)), out, f"b{i}"))
            for i in range(2)]
    for t in bigs:
        t.start()
    time.sleep(0.3)
    _timed(srv.url, _chat("Hi"), out, "small")
    for t in bigs:
        t.join(300)
    small_r, small_s, small_end = out["small"]
    assert small_r.status_code == 200, small_r.text
    assert all(out[f"b{i}"][0].status_code == 400 for i in range(2))
    assert small_end < min(out["b0"][2], out["b1"][2])


def test_big_calls_take_turns_in_one_worker(smol_engine: Any) -> None:
    """Two workers: while one big call is held, a second big call waits for it and a small
    one runs in the other worker. Held by the order of events, not by times (a ratio of
    two preparations' wall times failed once on a busy machine)."""
    pool = PreparePool(smol_engine.with_pool(16), workers=2, big_bytes=10)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def call(name: str) -> Callable[[Any], str]:
        def fn(engine: Any) -> str:
            order.append(f"{name} start")
            if name == "b0":
                started.set()
                release.wait(60)
            order.append(f"{name} end")
            return name
        return fn

    async def scenario() -> list[str]:
        b0 = asyncio.ensure_future(pool.run(call("b0"), body_bytes=100))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        b1 = asyncio.ensure_future(pool.run(call("b1"), body_bytes=100))
        small = await pool.run(call("small"), body_bytes=1)
        await asyncio.sleep(0.1)  # time for b1 to start, were it let in
        release.set()
        return [await b0, await b1, small]

    try:
        assert asyncio.run(scenario()) == ["b0", "b1", "small"]
    finally:
        pool.close()
    assert order == ["b0 start", "small start", "small end", "b0 end", "b1 start", "b1 end"]


def test_workers_share_no_tokenizer(smol_engine: Any) -> None:
    """Four calls held in the pool at once (a barrier): four tokenizers, none of them
    the engine's, which every other thread still gets. A Hugging Face fast tokenizer
    keeps ``split_special_tokens`` on itself, so two threads sharing one can tokenise a
    plain prompt with a DA render's setting (two threads on SmolLM2's tokenizer: 24 of
    200 plain calls lost their special tokens)."""
    engine = smol_engine.with_pool(16)  # the pool wraps this engine's tokenizer, not the model's
    original = engine.tokenizer
    pool = PreparePool(engine, workers=4)
    barrier = threading.Barrier(4, timeout=60)

    def held(engine: Any) -> int:
        barrier.wait()  # all four workers busy together
        return id(engine.tokenizer.current)

    async def four() -> list[int]:
        return list(await asyncio.gather(*(pool.run(held) for _ in range(4))))

    try:
        ids = asyncio.run(four())
    finally:
        pool.close()
    assert len(set(ids)) == 4 and id(original) not in ids
    assert engine.tokenizer.current is original  # this thread is no worker
    assert smol_engine.tokenizer is original  # the model's own engine is left alone


def test_workers_prepare_what_the_engine_would(smol_engine: Any) -> None:
    """The same prompt ids from the workers' copies as from the tokenizer itself, DA and
    plain, several at once."""
    from declattn.server.prepare import Limits, prepare_chat
    from declattn.server.schemas import ChatCompletionRequest

    limits = Limits(max_positions=8192, pool_blocks=1024, block_size=16)
    plain = ChatCompletionRequest.model_validate(_chat("<|im_start|>hello " * 50))
    da = ChatCompletionRequest.model_validate(_chat(
        "Who was the keeper?", declarative_attention={"context": da_context(0) + " <|im_end|>"}))
    expected = [prepare_chat(smol_engine, r, limits).prompt_ids for r in (plain, da)]
    pool = PreparePool(smol_engine.with_pool(16), workers=4)

    async def many() -> list[list[int]]:
        jobs = [pool.run(lambda engine, r=r: prepare_chat(engine, r, limits).prompt_ids)
                for _ in range(8) for r in (plain, da)]
        return list(await asyncio.gather(*jobs))

    try:
        got = asyncio.run(many())
    finally:
        pool.close()
    assert got == expected * 8
