"""The logits processor's row table follows vLLM's batch updates (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.sample.logits_processor")  # a real vLLM, not this folder

from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from declattn.session import DAOptions  # noqa: E402
from declattn.vllm import build_request, link  # noqa: E402
from declattn.vllm.processor import DALogitsProcessor  # noqa: E402

CONTEXT = "\n\n".join(f"Paragraph {i}: day {i} had {i * 3} boats in the harbour." * 3
                      for i in range(1, 9))


def _params(extra=None):
    return SimpleNamespace(extra_args=extra)


@pytest.fixture
def processor(smol_tokenizer, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer="unused"))
    proc = DALogitsProcessor(config, device=None, is_pin_memory=False)
    proc._tokenizer = smol_tokenizer
    yield proc
    link.unregister(config)


def _update(size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added),
                       moved=list(moved))


def _labels(proc):
    return {row: t.spec.label for row, t in proc.rows.items()}


def test_rows_follow_adds_moves_swaps_and_replacements(processor, smol_tokenizer) -> None:
    opts = DAOptions(target=64, cap=96)
    a = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, opts, label="a")
    b = build_request(CONTEXT, "Boats on day 5?", smol_tokenizer, opts, label="b")
    assert link.lookup(processor.vllm_config) is processor
    processor.update_state(_update(3, added=[
        (0, _params(a.extra_args), a.prompt_token_ids, []),
        (1, _params(), [1, 2], []),  # plain: never tracked
        (2, _params(b.extra_args), b.prompt_token_ids, []),
    ]))
    assert _labels(processor) == {0: "a", 2: "b"}
    processor.update_state(_update(2, moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert _labels(processor) == {0: "a", 1: "b"}
    processor.update_state(_update(2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert _labels(processor) == {0: "b", 1: "a"}
    # a request added (or moved) onto a row replaces the one there, which has finished
    processor.update_state(_update(2, added=[(0, _params(), [3], [])]))
    assert _labels(processor) == {1: "a"}
    assert processor.reads("b") == []  # finished, still readable
    processor.update_state(_update(1, moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    processor.update_state(_update(0, removed=[0]))
    assert processor.rows == {}
    with pytest.raises(KeyError):
        processor.reads("nobody")


def test_vllm_plugins_without_declattn_switches_it_off(smol_tokenizer, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer="unused"))
    proc = DALogitsProcessor(config, device=None, is_pin_memory=False)
    req = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, DAOptions(target=64, cap=96))
    proc.update_state(_update(1, added=[(0, _params(req.extra_args), [], [])]))
    assert proc.rows == {} and proc.is_argmax_invariant()
    assert link.lookup(config) is None


def test_malformed_da_args_are_refused_at_validation() -> None:
    from declattn.vllm.xargs import BadDAArgs

    with pytest.raises(BadDAArgs):
        DALogitsProcessor.validate_params(_params({"da_prompt_len": 10, "da_chunks": [1]}))
    DALogitsProcessor.validate_params(_params({"temperature_like": 1}))  # plain: fine


# -- the builder wrapper, on a stand-in builder ---------------------------------------
class _FakeProcessor:
    """Row 1 is a DA decode row keeping blocks 0 and 3; row 0 is a DA row in prefill."""

    def __init__(self):
        self.rows = {0: object(), 1: object()}
        self.recorded = []

    def kept_blocks(self, row, length, block_size):
        return (0, (length - 1) // block_size) if row == 1 else (0,)

    def record(self, row, builder, length, kept, physical, seq_len):
        self.recorded.append((row, length, kept, physical, seq_len))


def _common(num_reqs_lens, query_lens):
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(num_reqs_lens, dtype=torch.int32)
    table = torch.arange(1, 1 + 8 * len(query_lens), dtype=torch.int32).reshape(-1, 8)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=lens,
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=int(lens.max()), block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens.clone(),
    )


def test_wrapper_compacts_only_da_decode_rows_and_copies_what_it_changes() -> None:
    import torch

    from declattn.vllm.patch import _wrap

    calls = []

    def build(self, common_prefix_len, cm, fast_build=False):
        calls.append((common_prefix_len, cm))
        return "metadata"

    config = SimpleNamespace()
    builder = SimpleNamespace(vllm_config=config, block_size=32)
    builder.__dict__["_declattn_eligible"] = True  # a full-attention group
    wrapped = _wrap(build)
    # row 0: DA, prefilling (5 query tokens); row 1: DA decode at length 120 (blocks 0..3);
    # row 2: plain decode
    cm = _common([60, 120, 90], [5, 1, 1])
    table, lens = cm.block_table_tensor.clone(), cm.seq_lens.clone()
    processor = _FakeProcessor()
    link.register(config, processor)
    try:
        assert wrapped(builder, 64, cm) == "metadata"
    finally:
        link.unregister(config)
    prefix, new = calls[-1]
    assert prefix == 0  # no cascade attention over compacted rows
    assert torch.equal(cm.block_table_tensor, table) and torch.equal(cm.seq_lens, lens)
    assert new.block_table_tensor[1, :2].tolist() == [table[1, 0].item(), table[1, 3].item()]
    assert new.seq_lens[1].item() == 32 + (120 - 96)
    for row in (0, 2):  # the prefill row and the plain row are as they were
        assert torch.equal(new.block_table_tensor[row], table[row])
        assert new.seq_lens[row].item() == lens[row].item()
    assert new.max_seq_len == 90
    assert processor.recorded == [(1, 120, (0, 3), (table[1, 0].item(), table[1, 3].item()), 56)]
    # without a processor for this engine the stock build gets the very same arguments
    assert wrapped(builder, 64, cm) == "metadata" and calls[-1] == (64, cm)


def test_sliding_window_groups_are_left_alone() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from declattn.vllm.patch import _full_attention

    common = dict(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    for spec, window in (
        (SlidingWindowSpec(sliding_window=512, **common), -1),
        (FullAttentionSpec(sliding_window=512, **common), -1),
        (FullAttentionSpec(**common), 512),  # a CPU group whose layers share a window
    ):
        builder = SimpleNamespace(kv_cache_spec=spec, window_size=window, layer_names=[])
        assert not _full_attention(builder)
