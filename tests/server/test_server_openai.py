"""The official ``openai`` client against the real server: plain and DA, streamed or not."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import MODEL, da_context

from declattn.server.metrics import parse

openai = pytest.importorskip("openai")

DA = {"context": da_context(1), "chunk_tokens": 16, "min_context": 0}  # DA, not the gate
QUESTION = "Who was the keeper?"


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=512)


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600)


def _extra(usage: Any) -> dict[str, Any]:
    return usage.model_extra or {}


def _chat(client: Any, **kwargs: Any) -> Any:
    base = {"model": MODEL, "temperature": 0.0, "max_tokens": 8}
    return client.chat.completions.create(**{**base, **kwargs})


def _joined(stream: Any) -> tuple[str, str | None, Any, list[Any]]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next((c.choices[0].finish_reason for c in chunks
                   if c.choices and c.choices[0].finish_reason), None)
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    return text, finish, usage, chunks


def test_models_health_and_model_card(server: Any, client: Any) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_plain_chat_renders_the_chat_template(server: Any, client: Any) -> None:
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    r = _chat(client, messages=messages)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    tok = server.state.engine.tokenizer
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = _extra(r.usage)
    # vanilla reads everything: attended equals the vanilla figure, and it grows per step
    assert extra["attended_tokens"] == extra["vanilla_attended_tokens"] > 0
    assert "declarative_attention" not in extra


def test_plain_stream_equals_non_stream(client: Any) -> None:
    messages = [{"role": "user", "content": "Tell me about lighthouses."}]
    whole = _chat(client, messages=messages)
    text, finish, usage, chunks = _joined(
        _chat(client, messages=messages, stream=True, stream_options={"include_usage": True})
    )
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    _, _, no_usage, _ = _joined(_chat(client, messages=messages, stream=True))
    assert no_usage is None  # plain streams report usage only when asked


def test_stop_string_cuts_the_output(client: Any) -> None:
    messages = [{"role": "user", "content": "Tell me about lighthouses."}]
    full = _chat(client, messages=messages, max_tokens=12).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = _chat(client, messages=messages, max_tokens=12, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r2 = _chat(client, messages=messages, max_completion_tokens=3)
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client: Any) -> None:
    messages = [{"role": "user", "content": "Invent a name for a boat."}]
    a = _chat(client, messages=messages, temperature=1.0, top_p=0.9, seed=11)
    b = _chat(client, messages=messages, temperature=1.0, top_p=0.9, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_da_through_extra_body(client: Any) -> None:
    r = _chat(client, messages=[{"role": "user", "content": QUESTION}], max_tokens=10,
              extra_body={"declarative_attention": DA})
    usage = _extra(r.usage)
    report = usage["declarative_attention"]
    assert report["arm"] == "da"
    assert report["chunks"] >= 2
    assert report["decode_steps"] == r.usage.completion_tokens - 1
    assert usage["attended_tokens"] <= usage["vanilla_attended_tokens"]
    assert sum(m["steps"] for m in report["attended_tokens_by_mode"].values()) == (
        report["decode_steps"]
    )
    assert isinstance(report["declarations"], list) and isinstance(report["declines"], list)
    plain = _chat(client, messages=[{"role": "user", "content": QUESTION}], max_tokens=2)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # chunks + DA instruction


def test_da_stream_matches_and_always_reports_usage(client: Any) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = _chat(client, messages=messages, max_tokens=10,
                  extra_body={"declarative_attention": DA})
    text, finish, usage, _ = _joined(
        _chat(client, messages=messages, max_tokens=10, stream=True,
              extra_body={"declarative_attention": DA})
    )
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert _extra(usage)["declarative_attention"]["decode_steps"] == (
        _extra(whole.usage)["declarative_attention"]["decode_steps"]
    )


def test_documents_are_joined_with_blank_lines(client: Any) -> None:
    docs = ["The keeper was named Ada.", "Ada kept two goats on Skerry."]
    messages = [{"role": "user", "content": QUESTION}]
    a = _chat(client, messages=messages, max_tokens=6,
              extra_body={"declarative_attention": {"documents": docs, "chunk_tokens": 16}})
    b = _chat(client, messages=messages, max_tokens=6,
              extra_body={"declarative_attention": {"context": "\n\n".join(docs),
                                                    "chunk_tokens": 16}})
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_text_completions(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6,
                                  temperature=0.0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 6
    stream = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6,
                                       temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_metrics_count_what_was_served(server: Any, client: Any) -> None:
    before = parse(httpx.get(server.url + "/metrics").text)
    _chat(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    after = parse(text)
    key = 'declattn_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["declattn_generated_tokens_total"] >= before["declattn_generated_tokens_total"] + 1
    attended = after["declattn_attended_tokens_total"]
    assert after["declattn_vanilla_attended_tokens_total"] >= attended > 0
    assert after["declattn_kv_blocks_in_use"] == 0
    assert after["declattn_kv_blocks_free"] == after["declattn_kv_blocks_total"] == 512
    assert "# TYPE declattn_queue_depth gauge" in text


def test_ignore_eos_writes_up_to_max_tokens(client: Any) -> None:
    """``ignore_eos`` (vLLM's extension): the reply that stops by itself goes on to
    max_tokens, streamed or not; a non-boolean value is refused."""
    messages = [{"role": "user", "content": "Reply with the single word yes."}]
    short = _chat(client, messages=messages, max_tokens=40)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    long = _chat(client, messages=messages, max_tokens=40, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)
    _, finish, usage, _ = _joined(_chat(client, messages=messages, max_tokens=40, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}))
    assert finish == "length" and usage.completion_tokens == 40
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        _chat(client, messages=messages, extra_body={"ignore_eos": "sometimes"})
