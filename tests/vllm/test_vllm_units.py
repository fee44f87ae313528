"""The vLLM plugin's parts that need no vLLM: request args, compaction, request builder,
and the per-request tracker. These run in every environment."""

from __future__ import annotations

import math

import pytest
import torch

from declattn.api.session import DASession
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.protocol.layout import Layout, Span
from declattn.protocol.modes import Mode
from declattn.vllm.compact import compact_rows, compacted_length
from declattn.vllm.request import build_request
from declattn.vllm.tracker import RequestTracker
from declattn.vllm.xargs import BadDAArgs, DASpec, is_da, parse

LAYOUT = Layout(
    prompt_len=200,
    sink=Span(0, 16),
    chunks=(Span(20, 60), Span(64, 120), Span(124, 170)),
    question=Span(172, 200),
)

CONTEXT = "\n\n".join(
    f"Paragraph {i}: the harbour log for day {i} notes calm water, {i * 3} boats and "
    f"a keeper named Ada who counted gulls from the gallery." * 2
    for i in range(1, 9)
)
QUESTION = "How many boats were in the harbour on day 5?"
OPTIONS = DAOptions(target=96, cap=128)


# -- request args ----------------------------------------------------------------------
def test_spec_round_trips_through_flat_args() -> None:
    spec = DASpec(LAYOUT, line_start=True, masking=False, constrain=True, force=(5, 6), label="x",
                  open_tag=True, answer_after_find=True)
    args = spec.to_args()
    for value in args.values():  # what vllm_xargs accepts: scalars and flat lists
        assert isinstance(value, int | str) or all(isinstance(v, int) for v in value)
    assert parse(args) == spec
    assert parse(DASpec(LAYOUT).to_args()) == DASpec(LAYOUT)


def test_plain_requests_are_not_da() -> None:
    assert parse(None) is None
    assert parse({}) is None
    assert parse({"something_else": 1}) is None
    assert not is_da({"da_chunks": [1, 2]})


@pytest.mark.parametrize(
    "change",
    [
        {"da_chunks": [20, 60, 64]},  # odd
        {"da_chunks": []},  # no chunk
        {"da_chunks": [[20, 60]]},  # nested
        {"da_chunks": [64, 120, 20, 60]},  # out of order
        {"da_question": [172, 199]},  # does not end the prompt
        {"da_sink": [0, 30]},  # covers chunk 1
        {"da_masking": 2},
        {"da_prompt_len": "many"},
    ],
)
def test_malformed_da_args_are_refused(change: dict) -> None:
    args = {**DASpec(LAYOUT).to_args(), **change}
    with pytest.raises(BadDAArgs):
        parse(args)


# -- compaction ------------------------------------------------------------------------
def _paged_read(kv: torch.Tensor, table_row: torch.Tensor, length: int, bs: int) -> torch.Tensor:
    """What a paged kernel reads for one row: the first ``length`` positions of its blocks."""
    n = math.ceil(length / bs)
    return kv[table_row[:n]].reshape(n * bs, -1)[:length]


def test_compaction_makes_a_paged_read_return_exactly_the_kept_blocks() -> None:
    bs = 4
    kv = torch.randn(40, bs, 3)  # 40 physical blocks of 4 positions
    table = torch.tensor([[7, 3, 9, 1, 12, 30, 2, 0], [5, 6, 8, 10, 11, 13, 14, 15]])
    seq_lens = torch.tensor([27, 30])
    before = (table.clone(), seq_lens.clone())
    kept = {0: [0, 2, 3, 6]}  # newest position 26 sits in block 6
    out = compact_rows(table, seq_lens, {0: 27}, kept, bs)
    assert torch.equal(table, before[0]) and torch.equal(seq_lens, before[1])  # not written
    assert out.physical_of(0).tolist() == [7, 9, 1, 2]
    assert out.lengths[0] == int(out.seq_lens[0]) == 3 * bs + 3 == compacted_length(27, 4, bs)
    got = _paged_read(kv, out.block_table[0], int(out.seq_lens[0]), bs)
    full = _paged_read(kv, table[0], 27, bs)
    want = torch.cat([full[b * bs : (b + 1) * bs] for b in kept[0]])
    assert torch.equal(got, want)
    # the other row is untouched
    assert torch.equal(out.block_table[1], table[1]) and int(out.seq_lens[1]) == 30


def test_compaction_of_several_rows_is_one_gather_that_never_reads_the_device_back() -> None:
    """On the ``meta`` device every read-back (``.cpu()``, ``.item()``, ``.tolist()``)
    raises, so compaction finishing there proves it runs without a host sync."""
    bs = 4
    table = torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8)
    lens = torch.tensor([27, 30, 9], dtype=torch.int32)
    kept = {0: [0, 2, 6], 2: [0, 2]}
    lengths = {0: 27, 2: 9}
    host = compact_rows(table, lens, lengths, kept, bs)
    meta = compact_rows(table.to("meta"), lens.to("meta"), lengths, kept, bs)
    assert meta.block_table.device.type == "meta" and meta.lengths == host.lengths
    assert host.physical_of(0).tolist() == [0, 2, 6] and host.physical_of(2).tolist() == [16, 18]
    assert host.block_table[0].tolist() == [0, 2, 6, 0, 0, 0, 0, 0]
    assert host.block_table[1].tolist() == table[1].tolist()
    assert host.seq_lens.tolist() == [2 * bs + 3, 30, bs + 1]


def test_compaction_refuses_a_view_without_the_newest_block() -> None:
    table = torch.arange(8).reshape(1, 8)
    with pytest.raises(ValueError):
        compact_rows(table, torch.tensor([27]), {0: 27}, {0: [0, 1]}, 4)
    with pytest.raises(ValueError):
        compact_rows(table, torch.tensor([27]), {0: 27}, {0: [2, 1, 6]}, 4)


# -- request builder -------------------------------------------------------------------
def test_request_is_the_prompt_and_layout_our_engine_runs(smol_tokenizer) -> None:
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, OPTIONS, label="r")
    sess = DASession(smol_tokenizer, CONTEXT, QUESTION, OPTIONS)
    assert req.prompt_token_ids == sess.prompt_ids
    assert req.layout == sess.layout
    assert req.layout.n_chunks > 2
    spec = parse(req.extra_args)
    assert spec is not None and spec.layout == sess.layout and spec.label == "r"
    assert req.prompt() == {"prompt_token_ids": sess.prompt_ids}
    body = req.http_body("m", max_tokens=5)
    assert body["vllm_xargs"] == req.extra_args and body["max_tokens"] == 5
    with pytest.raises(ValueError):
        build_request(CONTEXT, "  ", smol_tokenizer)


# -- tracker ---------------------------------------------------------------------------
TRANSCRIPT = (
    "<global>Day 5 is in chunk 2.</global>\n"
    '<focus magic_chunks="2">day 5 notes 15 boats</focus>\n'
    "<local>So 15.</local>\n<answer>15</answer>"
)


def test_tracker_follows_the_live_output_list_with_the_engines_one_step_lag(
    smol_tokenizer,
) -> None:
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, OPTIONS)
    ids = smol_tokenizer.encode(TRANSCRIPT, add_special_tokens=False)
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer)
    texts = [smol_tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    token_texts = [texts[0]] + [texts[k][len(texts[k - 1]) :] for k in range(1, len(ids))]
    expected = replay(req.layout, token_texts, block_size=32).steps
    lay = req.layout
    modes = set()
    for k, token in enumerate(ids):
        if k >= 1:  # decode step k sees prompt_len + k positions, reads tokens 0..k-1's scope
            step = expected[k - 1]
            scope = tracker.scope()
            assert (scope.mode, scope.focus_ids) == (step.mode, step.focus_ids)
            blocks = tracker.kept_blocks(lay.prompt_len + k, 32)
            assert blocks == tuple(scope.kept_blocks(lay.prompt_len + k, 32))
            assert tracker.kept_blocks(lay.prompt_len + k + 1, 32) is None  # not this step
            modes.add(scope.mode)
        live.append(token)
    assert {Mode.GLOBAL, Mode.FOCUS, Mode.LOCAL, Mode.ANSWER} <= modes
    live.append(-1)  # an async-scheduling placeholder is not a token
    assert tracker.n_out == len(ids)
    tracker.sync()
    assert tracker.text == smol_tokenizer.decode(ids, skip_special_tokens=True)


def test_tracker_forces_then_leaves_logits_alone(smol_tokenizer) -> None:
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, OPTIONS, force=[11, 22])
    live: list[int] = []
    tracker = RequestTracker(req.spec, live, smol_tokenizer)
    row = torch.randn(100)
    forced = tracker.process_logits(row.clone())
    assert int(forced.argmax()) == 11 and torch.isinf(forced).sum() == 99
    live.append(11)
    assert int(tracker.process_logits(row.clone()).argmax()) == 22
    live.append(22)
    assert torch.equal(tracker.process_logits(row.clone()), row)


def test_dana_requests_are_tracked_but_never_skip(smol_tokenizer) -> None:
    opts = DAOptions(target=96, cap=128, masking=False)
    req = build_request(CONTEXT, QUESTION, smol_tokenizer, opts)
    tracker = RequestTracker(req.spec, [1, 2], smol_tokenizer)
    assert tracker.kept_blocks(req.layout.prompt_len + 2, 32) is None


@pytest.mark.parametrize(
    ("window", "is_global"),
    [
        (None, True),  # the model layer, FlexAttention
        (-1, True),  # CPU_ATTN
        ((-1, -1), True),  # FlashAttention, Triton, FlashInfer, ROCm
        ([-1, -1], True),
        ((511, 0), False),  # a causal 512-token window, FlashAttention's way
        ((511, 511), False),
        (512, False),
    ],
)
def test_every_backends_no_window_convention_counts_as_global(window, is_global) -> None:
    from declattn.vllm.support import window_is_global

    assert window_is_global(window) is is_global


def test_an_engine_that_is_gone_leaves_no_processor_behind() -> None:
    import gc
    from types import SimpleNamespace

    from declattn.vllm import link

    class Processor:
        pass

    config, other = SimpleNamespace(), SimpleNamespace()
    proc = Processor()
    link.register(config, proc)
    assert link.lookup(config) is proc and link.lookup(other) is None
    assert proc in link.processors()
    del proc
    gc.collect()
    assert link.lookup(config) is None
    assert all(not isinstance(p, Processor) for p in link.processors())


def test_the_scaffold_rule_travels_and_jump_forward_is_said_to_be_absent(
    smol_tokenizer,
) -> None:
    """An economy request carries its scaffold rule to the engine core (so the tracker
    reads what our engine reads); jump-forward does not exist in vLLM's scheduler, and
    the request builder says so instead of silently decoding tag text token by token."""
    o = DAOptions.economy(target=96, cap=128)
    with pytest.warns(UserWarning, match="jump-forward is not available through vLLM"):
        req = build_request(CONTEXT, QUESTION, smol_tokenizer, o)
    assert req.spec.scaffold_local and req.spec.open_tag
    assert parse(req.spec.to_args()) == req.spec
    quiet = DAOptions.economy(target=96, cap=128, jump_forward=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_request(CONTEXT, QUESTION, smol_tokenizer, quiet)
