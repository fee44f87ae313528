"""Shared fixtures for the training tests: the tiny tokenizer and a random tiny Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """The two cores are shared; one thread keeps small ops from waiting on a time slice."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def tiny_tok() -> Any:
    from declattn.train.data import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="package", params=[False, True], ids=["llama", "aided"])
def random_tiny(request: Any, tiny_tok: Any) -> Any:
    """An untrained da-tiny-shaped model in fp32, plain Llama or with the learning aids:
    its logits are arbitrary but exact."""
    from declattn.train.da_tiny import TinySpec, hf_config, new_model

    spec = TinySpec(layers=2, aids=request.param)
    model = new_model(hf_config(spec, len(tiny_tok), tiny_tok.eos_token_id), seed=1).eval()
    if request.param:  # random aids at init scale would barely move the logits
        with torch.no_grad():
            for p in [*model.shift.parameters(), *model.segment_embed.parameters()]:
                p.normal_(std=0.5)
    return model
