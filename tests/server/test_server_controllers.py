"""The fault fence forwards every controller hook, so a request served through the
server runs exactly as it runs through the engine facade.

The bug this pins: the fence used to forward only view, logits and token hooks, and the
engine looked up the layout with ``getattr`` on the controller it held. Behind the fence
the layout was invisible: a DA request to ``da-tiny`` (whose tokens mix their region
into their embedding) ran with plain-prompt regions, and answered from garbage.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from declattn.api import Engine
from declattn.engine.controller import Controller
from declattn.protocol.layout import RESPONSE, SCAFFOLD
from declattn.server.controllers import Guarded
from declattn.train.evaluate import EVAL_SEED_BASE
from declattn.train.tasks import make_episode


class Recorder(Controller):
    """Says which hooks the engine asked for."""

    selects_blocks = True

    def __init__(self) -> None:
        super().__init__([1, 2, 3])
        self.calls: list[str] = []

    def view(self, length: int) -> list[int]:
        self.calls.append("view")
        return [0]

    def select_blocks(self, layer: int, q: torch.Tensor) -> list[int]:
        self.calls.append("select_blocks")
        return [0]

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls.append("process_logits")
        return logits + 1

    def on_token(self, token_id: int, text: str) -> str | None:
        self.calls.append("on_token")
        return "stop-here"

    def regions(self, start: int, stop: int) -> list[int]:
        self.calls.append("regions")
        return [7] * (stop - start)


def test_the_fence_forwards_every_hook() -> None:
    inner = Recorder()
    g = Guarded(inner)
    assert g.prompt_ids == inner.prompt_ids and g.selects_blocks
    assert g.view(3) == [0] and g.select_blocks(0, torch.zeros(1, 1)) == [0]
    assert torch.equal(g.process_logits(torch.zeros(2)), torch.ones(2))
    assert g.on_token(5, "x") == "stop-here" and g.regions(0, 2) == [7, 7]
    assert inner.calls == [
        "view", "select_blocks", "process_logits", "on_token", "regions"
    ]
    plain = Controller([1, 2])
    assert plain.regions(1, 4) == [SCAFFOLD, RESPONSE, RESPONSE]


def test_a_failing_hook_fails_only_its_request() -> None:
    class Broken(Recorder):
        def view(self, length: int) -> list[int]:
            raise ValueError("bad view")

    g = Guarded(Broken())
    assert g.view(3) is None  # the safe view: everything
    assert g.select_blocks(0, torch.zeros(1, 1)) is None  # defers to the view
    assert g.on_token(1, "x") == "error" and isinstance(g.error, ValueError)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("da-tiny", dtype="fp32")


def test_da_tiny_through_the_server_answers_as_through_the_engine(
    engine: Engine, server_factory: Any
) -> None:
    import httpx

    srv = server_factory(engine, kv_blocks=512)
    rng = random.Random(EVAL_SEED_BASE + 77)
    right = 0
    for _ in range(4):
        ep = make_episode(rng, 16, False)
        local = engine.answer(ep.context, ep.question, max_tokens=64)
        body = {
            "model": "smollm2-135m",  # the test server's model id
            "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": ep.question}],
            "declarative_attention": {"context": ep.context},
        }
        r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()
        assert served["choices"][0]["message"]["content"] == local.text
        report = served["usage"]["declarative_attention"]
        assert report["answer"] == local.answer
        right += local.answer == ep.answer
    assert right >= 3  # the regions are right: da-tiny answers from its own tags
