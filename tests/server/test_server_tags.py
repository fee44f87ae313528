"""DA tags through the server: hold-back in streams, ``return_tags``, declarations, reads.

SmolLM2-135M rarely writes DA tags on its own, so these tests force its output: the DA
session the server builds is wrapped so that its logits hook leaves only the next token
of a scripted response. Everything else is real: the model runs every step, the tag
reader reads the forced text, the scope narrows the engine's reads, and the response
goes through the HTTP server and the ``openai`` client.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import MODEL, da_context

from declattn.server.scheduler import _strip

openai = pytest.importorskip("openai")

SCRIPT = (
    '<focus magic_chunks="9">no</focus>\n'
    "<global>Near the start.</global>\n"
    '<focus magic_chunks="1">named Bram</focus>\n'
    "<local>So, Bram.</local>\n"
    "<answer>Bram</answer>"
)


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=256)


@pytest.fixture
def forced(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server.state.engine
    ids = list(engine.tokenizer.encode(SCRIPT, add_special_tokens=False))
    real = engine.session

    def session(*args: Any, **kwargs: Any) -> Any:
        """The real DA session, whose every next token is the script's next one."""
        sess = real(*args, **kwargs)

        def process_logits(logits: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(logits, float("-inf"))
            forced[ids[min(sess.n_tokens, len(ids) - 1)]] = 0.0
            return forced

        sess.process_logits = process_logits
        sess.forced = lambda: None  # the script fixes every token: no jump-forward
        return sess

    monkeypatch.setattr(engine, "session", session)


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600)


def _request(client: Any, return_tags: str, stream: bool) -> Any:
    da = {"context": da_context(1), "chunk_tokens": 16, "return_tags": return_tags,
          "min_context": 0}
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who was the keeper?"}],
        temperature=0.0,
        max_tokens=80,
        stream=stream,
        extra_body={"declarative_attention": da},
    )


def _stripped(text: str) -> str:
    return re.sub(r"</?(global|focus|local|answer)[^>]*>", "", text)


@pytest.mark.usefixtures("forced")
def test_tags_in_content_and_the_da_report(client: Any) -> None:
    r = _request(client, "content", stream=False)
    assert r.choices[0].message.content == SCRIPT
    assert r.choices[0].finish_reason == "stop"
    report = r.usage.model_extra["declarative_attention"]
    assert report["answer"] == "Bram"
    assert report["finish_reason"] == "answer"
    kinds = [d["kind"] for d in report["declarations"]]
    assert kinds == ["focus", "/focus", "global", "/global", "focus", "/focus", "local",
                     "/local", "answer", "/answer"]
    assert [d["reason"] for d in report["declines"]] == ["unknown chunk id"]
    assert '"9"' in report["declines"][0]["tag"]
    modes = report["attended_tokens_by_mode"]
    assert modes["focus"]["steps"] > 0 and modes["local"]["steps"] > 0
    # focus and local read less than everything, so the whole response reads less
    assert modes["focus"]["logical"] < modes["focus"]["vanilla_logical"]
    assert modes["local"]["logical"] < modes["local"]["vanilla_logical"]
    usage = r.usage.model_extra
    assert usage["attended_tokens"] < usage["vanilla_attended_tokens"]
    assert "declarations" not in (r.choices[0].message.model_extra or {})


@pytest.mark.usefixtures("forced")
def test_strip_moves_tags_out_of_the_content(client: Any) -> None:
    r = _request(client, "strip", stream=False)
    assert r.choices[0].message.content == _stripped(SCRIPT)
    decls = r.choices[0].message.model_extra["declarations"]
    assert [d["tag"] for d in decls] == re.findall(r"</?(?:global|focus|local|answer)[^>]*>",
                                                   SCRIPT)


@pytest.mark.usefixtures("forced")
def test_stream_never_shows_half_a_tag(client: Any) -> None:
    chunks = list(_request(client, "content", stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == SCRIPT
    for d in deltas:
        assert re.search(r"<[^>]*$", d) is None, f"a delta ends inside a tag: {d!r}"
    assert sum(bool(d) for d in deltas) > 5  # it did stream, piece by piece
    usage = next(c.usage for c in chunks if c.usage is not None)
    assert usage.model_extra["declarative_attention"]["answer"] == "Bram"


@pytest.mark.usefixtures("forced")
def test_stream_strip(client: Any) -> None:
    chunks = list(_request(client, "strip", stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == _stripped(SCRIPT)
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1
    assert len(final[0].choices[0].delta.model_extra["declarations"]) == 10


def test_strip_cuts_only_the_tag_spans() -> None:
    from declattn.protocol.tags import TagReader

    text = 'ab<global>cd</global>e<focus magic_chunks="2">f'
    reader = TagReader(3)
    reader.feed(text)
    reader.finish()
    assert _strip(text, 0, reader.declarations) == "abcdef"
    # a piece that starts mid-output is cut by the same absolute offsets
    assert _strip(text[4:], 4, reader.declarations) == "cdef"
    assert _strip(text[22:], 22, reader.declarations) == "f"
