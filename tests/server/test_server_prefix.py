"""Prefix caching through the server: a second request over the same document reuses
its prompt K/V, says so in ``usage.prompt_tokens_details.cached_tokens``, and answers
exactly what a server without the cache answers; concurrent requests sharing the
document answer what each answers alone. SmolLM2 in fp32, greedy."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context

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
