"""A tiny random Llama saved as a Hugging Face directory with SmolLM2's tokenizer and chat
template: the CLI's whole path (load, prompt, stream, records) in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def long_doc(tmp_path_factory, smol_tokenizer) -> Path:
    """About 3K tokens of prose: past one 2,048-token chunk, so DA has chunks to skip and
    the plain prompt over the same chunks shares whole prefill chunks with the DA one."""
    from declattn.corpora.essays import planted_document, planted_fact
    from declattn.protocol.segment import token_counter

    fact, _, _ = planted_fact(0)
    doc = planted_document(token_counter(smol_tokenizer), 3000, fact, 0)
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(doc.text)
    return path
