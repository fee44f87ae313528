"""Our own server as the eval harness's LLM judge: the judge's request, as it is sent to
any OpenAI-compatible endpoint, answered by the real server over loopback."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import MODEL

from declattn.eval.judge import Judge


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(kv_blocks=256)


def test_the_server_answers_the_judge(server: Any) -> None:
    judge = Judge(server.v1, MODEL, api_key="unused", timeout=300)
    out = judge("How many goats did Ada keep?", ["two goats", "2"], "She kept two goats.")
    assert out["judge"] == {"base_url": server.v1, "model": MODEL}
    assert out["reply"].strip()  # the model's own words, at most the judge's 4 tokens
    assert isinstance(out["verdict"], bool)
    assert out["verdict"] == out["reply"].strip().upper().startswith("YES")
