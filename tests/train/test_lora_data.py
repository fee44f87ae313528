"""A da-lora training sequence is the request the engine builds: the same prompt as a DA
session with the model's settings, later questions as the turns a conversation's
history renders, loss on the replies only."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from declattn.api.session import DASession
from declattn.corpora.build import TaskData
from declattn.protocol.prompt import render_prompt
from declattn.protocol.segment import segment, token_counter
from declattn.train.da_lora import LoRARun
from declattn.train.lora_data import encode_case
from declattn.train.lora_tasks import planted

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok() -> Any:
    from declattn.engine.loader import load_model
    from declattn.engine.registry import resolve_model

    return load_model(resolve_model("smollm2-135m"), dtype=torch.float32).tokenizer


def _case(tok: Any, seed: int) -> Any:
    data = TaskData.for_tokenizer(tok, part="train")
    rng = random.Random(seed)
    while True:
        case = planted(data, rng, 1500)
        if len(case.questions) >= 2:
            return case


def test_the_sequence_is_the_sessions_prompt_then_the_turns(tok: Any) -> None:
    options = LoRARun().options()
    case = _case(tok, 4)
    ex = encode_case(tok, case, options, random.Random(0))
    assert ex is not None and len(ex.replies) >= 2
    sess = DASession(tok, case.context, case.questions[0].question, options)
    p = sess.layout.prompt_len
    assert ex.layout == sess.layout and ex.input_ids[:p] == list(sess.prompt_ids)
    # the second question as a conversation's next request renders the same tokens
    chunks = segment(case.context, token_counter(tok), options.target, options.cap)
    second = render_prompt(
        tok, chunks, case.questions[1].question, sink=options.sink, style=options.style,
        instruction=options.instruction, history=[(case.questions[0].question, ex.replies[0])],
    )
    n = len(second.token_ids)
    assert ex.input_ids[:n] == second.token_ids
    # labels: exactly the reply tokens
    labelled = [i for i, t in enumerate(ex.labels) if t != -100]
    reply_ids = [tok.encode(r, add_special_tokens=False) for r in ex.replies]
    assert len(labelled) == sum(map(len, reply_ids))
    assert [ex.labels[i] for i in labelled[: len(reply_ids[0])]] == reply_ids[0]
    assert labelled[0] == p - 1 and all(i >= p - 1 for i in labelled)
    assert ex.frozen == sess.layout.question.start
    assert not any(t != -100 for t in ex.labels[: ex.frozen])


def test_find_steps_read_only_the_scaffold(tok: Any) -> None:
    """The rows that write the find words read no chunk (the scaffold rule)."""
    options = LoRARun().options()
    ex = encode_case(tok, _case(tok, 5), options, random.Random(0))
    assert ex is not None
    lay = ex.layout
    p = lay.prompt_len
    reply = tok.encode(ex.replies[0], add_special_tokens=False)
    head = len(tok.encode(ex.replies[0].split('">')[0], add_special_tokens=False))
    for k in range(1, head - 1):  # decode steps inside <focus find="...
        row = ex.mask[p - 1 + k]
        assert not any(bool(row[s.start:s.end].any()) for s in lay.chunks), k
    answer = ex.replies[0].index("<answer>") + len("<answer>")
    k = len(tok.encode(ex.replies[0][:answer], add_special_tokens=False)) + 1
    assert k < len(reply)
    row = ex.mask[p - 1 + k]  # a step writing the answer reads its focused chunk
    assert sum(bool(row[s.start:s.end].any()) for s in lay.chunks) >= 1
