"""``declattn.Client`` against the real server, and the ``declattn serve`` command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context, free_port

import declattn
from declattn.server.client import ClientAnswer, ServerError

QUESTION = "Who was the keeper?"


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=256)


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    with declattn.Client(server.url + "/v1/") as c:  # a /v1 suffix is accepted too
        yield c


def test_client_is_exported_lazily() -> None:
    from declattn.server.client import Client

    assert declattn.Client is Client


def test_answer_matches_the_raw_request(server: Any, client: Any) -> None:
    assert client.models() == [MODEL]
    assert client.health()["status"] == "ok"
    got = client.answer(da_context(2), QUESTION, chunk_tokens=16, max_tokens=8, min_context=0)
    assert isinstance(got, ClientAnswer)
    assert got.usage["declarative_attention"]["chunks"] >= 2
    assert got.usage["attended_tokens"] <= got.usage["vanilla_attended_tokens"]
    assert got.declarations == got.usage["declarative_attention"]["declarations"]
    assert got.answer == got.usage["declarative_attention"]["answer"]
    assert 0.0 <= got.saving < 1.0
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0.0,
        "max_tokens": 8,
        "declarative_attention": {"context": da_context(2), "chunk_tokens": 16,
                                  "min_context": 0},
    }).json()
    assert got.text == raw["choices"][0]["message"]["content"]  # greedy by default
    assert got.usage["completion_tokens"] == raw["usage"]["completion_tokens"]


def test_answer_over_documents(client: Any) -> None:
    docs = ["The keeper was named Ada.", "Ada kept two goats on Skerry."]
    got = client.answer(docs, QUESTION, chunk_tokens=16, max_tokens=4, return_tags="strip")
    joined = client.answer("\n\n".join(docs), QUESTION, chunk_tokens=16, max_tokens=4,
                           return_tags="strip")
    assert got.text == joined.text
    assert got.usage["prompt_tokens"] == joined.usage["prompt_tokens"]


def test_client_errors(client: Any) -> None:
    with pytest.raises(ServerError) as info:
        client.answer("some text", QUESTION, chunk_tokens=64, chunk_cap=8)
    assert info.value.status == 400
    assert info.value.param == "declarative_attention.chunk_cap"
    with pytest.raises(TypeError, match="chunk_size"):
        client.answer("some text", QUESTION, chunk_size=8)


def test_serve_command_runs_a_server() -> None:
    """``declattn serve`` in a subprocess: it loads the model and answers on its port."""
    from declattn.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", MODEL, "--kv-blocks", "64"])
    assert (args.host, args.port, args.max_batch, args.kv_blocks) == ("127.0.0.1", 8000, 32, 64)
    port = free_port()
    launcher = "import sys; from declattn.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", launcher, "serve", "--model", MODEL, "--port",
           str(port), "--kv-blocks", "64", "--max-tokens-cap", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "declattn serve did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] <= 2  # --max-tokens-cap
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from declattn.cli import main

    assert main(["serve", "--model", MODEL, "--max-batch", "0"]) == 2
    assert "--max-batch must be at least 1" in capsys.readouterr().err
