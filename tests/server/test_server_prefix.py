"""Prefix caching through the server: a second request over the same document reuses
its prompt K/V, says so in ``usage.prompt_tokens_details.cached_tokens``, and answers
exactly what a server without the cache answers; concurrent requests sharing the
document answer what each answers alone; a new server reads the document's K/V from the
cache's disk tier. SmolLM2 in fp32, greedy."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context

from declattn.engine.paths import KV_CACHE_DIR_ENV
from declattn.server.metrics import parse

DOC = "\n\n".join(da_context(i) for i in range(12))  # about 1,000 tokens
QUESTIONS = ("Who was the keeper?", "Which island had one well?", "How often came supplies?")


@pytest.fixture(scope="module")
def cached(server_factory: Any) -> Any:
    return server_factory(kv_blocks=512)


@pytest.fixture(scope="module")
def uncached(server_factory: Any) -> Any:
    return server_factory(kv_blocks=512, prefix_caching=False)


def _ask(url: str, question: str, da: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 12}
    if da:
        body["messages"] = [{"role": "user", "content": question}]
        body["declarative_attention"] = {"context": DOC, "chunk_tokens": 128}
    else:
        body["messages"] = [{"role": "user", "content": f"{DOC}\n\n{question}"}]
    r = httpx.post(url + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("da", [False, True])
def test_a_second_question_reuses_the_document(cached: Any, uncached: Any, da: bool) -> None:
    for i, q in enumerate(QUESTIONS[:2]):
        got, ref = _ask(cached.v1, q, da), _ask(uncached.v1, q, da)
        assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hit = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        if i == 0:
            assert hit == 0
        else:  # the document, in whole prefill chunks
            assert hit >= 512 and hit % 512 == 0
    m = parse(httpx.get(cached.url + "/metrics").text)
    assert m["declattn_prefix_cache_hit_rate"] > 0 and m["declattn_kv_blocks_cached"] > 0
    assert m["declattn_kv_blocks_in_use"] == 0


def test_concurrent_requests_sharing_a_prefix_answer_as_alone(cached: Any) -> None:
    alone = [_ask(cached.v1, q, True)["choices"][0]["message"]["content"] for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: _ask(cached.v1, q, True), QUESTIONS))
    assert [r["choices"][0]["message"]["content"] for r in together] == alone
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in together)


def test_a_new_server_reads_the_document_from_disk(server_factory: Any) -> None:
    """The prefix cache's disk tier outlives a server: a new one over the same directory
    reads the document's K/V instead of prefilling it, and says where the KV came from."""
    first = server_factory(kv_blocks=512)
    got = _ask(first.v1, QUESTIONS[0], True)
    assert got["usage"]["prompt_cache"] == {
        "memory_tokens": 0, "disk_tokens": 0, "computed_tokens": got["usage"]["prompt_tokens"]
    }
    files = Path(os.environ[KV_CACHE_DIR_ENV])
    deadline = time.monotonic() + 120
    whole = got["usage"]["prompt_tokens"] // 512  # the prompt's whole prefill chunks
    while len(list(files.glob("*/*.safetensors"))) < whole:  # written in the background
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = server_factory(kv_blocks=512)
    again = _ask(second.v1, QUESTIONS[1], True)
    split = again["usage"]["prompt_cache"]
    assert split["disk_tokens"] >= 512 and split["disk_tokens"] % 512 == 0
    assert split["memory_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == split["disk_tokens"]
    assert split["computed_tokens"] == again["usage"]["prompt_tokens"] - split["disk_tokens"]
    m = parse(httpx.get(second.url + "/metrics").text)
    assert m["declattn_prompt_tokens_from_disk_total"] == split["disk_tokens"]
    assert m["declattn_prompt_tokens_computed_total"] == split["computed_tokens"]
    assert m["declattn_prompt_tokens_from_memory_total"] == 0
