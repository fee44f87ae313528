"""What keys the disk tier besides the tokens: model files (hashed once per version of
them), the weights as loaded, the KV layout, the engine, and the thread count for fp32
K/V only (bf16 prefill K/V does not depend on it; fp32 does on Intel's MKL)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from disk_world import BLOCK, CHUNK, engine
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.engine import PagedEngine
from declattn.engine.kvdisk.identity import (
    Namespace,
    model_identity,
    weights_fingerprint,
)
from declattn.engine.kvdisk.options import parse_size
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.sampler import SamplingParams


def test_the_weights_fingerprint_sees_other_weights_dtypes_and_modules() -> None:
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    fa = weights_fingerprint(a, full=False)
    assert fa == weights_fingerprint(tiny_model(seed=1), full=False)
    assert fa != weights_fingerprint(b, full=False)
    assert fa != weights_fingerprint(tiny_model(seed=1).bfloat16(), full=False)
    with torch.no_grad():
        a.layers[0].attn.q_proj.weight[0, 0] += 1.0  # inside the sampled first 4 KiB
    assert weights_fingerprint(a, full=False) != fa
    whole = model_identity(b, None, Path("unused"))  # no files: every byte of the weights
    assert whole.endswith(f"weights:{weights_fingerprint(b, full=True)}")


def test_the_model_config_as_loaded_is_part_of_the_identity() -> None:
    a = tiny_model(seed=1)
    before = model_identity(a, None, Path("unused"))
    rope = dataclasses.replace(a.config.rope_global, theta=500000.0)
    a.config = dataclasses.replace(a.config, rope_global=rope)  # no tensor changes
    assert model_identity(a, None, Path("unused")) != before


def test_every_field_of_a_namespace_changes_its_key() -> None:
    ns = Namespace("m", "files:x", "float32", 16, 512, 256, 2, 2, 16, "e", "p", 2)
    keys = {ns.key}
    for field, value in [("model", "files:y"), ("kv_dtype", "bfloat16"), ("block_size", 32),
                         ("prefill_chunk", 256), ("layers", 3), ("kv_heads", 1),
                         ("head_dim", 8), ("engine", "f"), ("platform", "q"), ("threads", 1)]:
        keys.add(dataclasses.replace(ns, **{field: value}).key)
    assert len(keys) == 11
    assert dataclasses.replace(ns, model_name="other name").key == ns.key


def _wide_model() -> Decoder:
    """Wide enough that torch's matmuls and attention split across threads."""
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
           "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 4096, "rope_theta": 10000.0,
           "tie_word_embeddings": True}
    torch.manual_seed(3)
    model = Decoder(ModelConfig.from_hf(cfg)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.eval()


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's thread count set to ``n`` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _prefill_kv_by_threads(model: Decoder) -> list[tuple[torch.Tensor, ...]]:
    """The K/V of one prompt prefilled with 1 thread, then with 2."""
    ids = prompt(3 * CHUNK + 5, 4)
    got = []
    for threads in (1, 2):
        with _threads(threads):
            eng = PagedEngine(model, Tok(), num_blocks=64, block_size=BLOCK,
                              prefill_chunk=CHUNK, prefix_caching=False)
            seq = eng.add(Controller(ids), SamplingParams(max_tokens=2, ignore_eos=True))
            while seq.prefilled < len(ids):
                eng.step()
            got.append(eng.cache.export_rows(seq.seq_id, 0, 3 * CHUNK))
    return got


def test_bf16_prefill_kv_does_not_depend_on_the_thread_count() -> None:
    got = _prefill_kv_by_threads(_wide_model().to(torch.bfloat16))
    assert all(torch.equal(x, y) for x, y in zip(got[0], got[1], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_fp32_kv_is_keyed_by_the_thread_count(dtype: torch.dtype, tmp_path: Path) -> None:
    model = _wide_model().to(dtype)
    keys = set()
    for threads in (1, 2):
        with _threads(threads):
            eng = engine(model, tmp_path)
            assert eng.disk is not None
            keys.add(eng.disk.namespace.key)
    assert len(keys) == (2 if dtype == torch.float32 else 1)


def test_sizes_parse_in_units_of_1024() -> None:
    assert parse_size("20G") == 20 * 1024**3
    assert parse_size("512m") == 512 * 1024**2
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size("300000") == 300000
    for bad in ("", "-1G", "0", "12 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
