"""The plugin against vLLM's own loaders, runner interfaces and attention metadata, no
engine needed: both runners' loaders take it, each runner's processor follows its
requests (V1 by batch row, V2 by slot), the builder wrapper compacts by the runner's
key, window conventions of every backend are read right, and features under which DA
cannot skip are flagged rather than counted as skipped.

Model Runner V2 cannot run on this CPU build (it needs Triton), so its path is driven
here through its real types: ``RequestState`` (with vLLM's UVA check turned off, since
this machine has no pinned memory), ``LogitsContext`` and ``CommonAttentionMetadata``
with ``req_idx``, as ``attn_utils.build_attn_metadata`` passes them.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from phrases import naming_phrase

pytest.importorskip("vllm.v1.sample.logits_processor")  # a real vLLM, not this folder

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from declattn.da.options import DAOptions  # noqa: E402
from declattn.vllm import PROCESSOR_FQCN, build_request, link, patch, support  # noqa: E402
from declattn.vllm.processor import DALogitsProcessor  # noqa: E402
from declattn.vllm.processor_v1 import V1DAProcessor  # noqa: E402
from declattn.vllm.processor_v2 import V2DAProcessor  # noqa: E402

CONTEXT = "\n\n".join(f"Paragraph {i}: day {i} had {i * 3} boats in the harbour." * 3
                      for i in range(1, 9))
OPTS = DAOptions(target=64, cap=96)
BLOCK = 16


@pytest.fixture(autouse=True)
def _plugin_on(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)


def kept_for(layout, tokenizer, outputs, length, block_size) -> tuple[int, ...]:
    """The kept blocks of the step that sees ``length`` positions after ``outputs``,
    rebuilt from the output text alone (our detokenizer, tag reader and scope)."""
    from declattn.da.scope import Scope
    from declattn.engine.detok import Detokenizer
    from declattn.protocol.tags import TagReader
    detok, reader = Detokenizer(tokenizer), TagReader(layout.n_chunks)
    for token in outputs:
        reader.feed(detok.add(token))
    return tuple(Scope(layout, reader.mode, reader.focus_ids).kept_blocks(length, block_size))


@pytest.fixture
def declattn_log(caplog):
    """The plugin's log lines, also where vLLM's logger keeps them from the root logger."""
    logger = logging.getLogger("vllm.declattn")
    direct = not logging.getLogger("vllm").propagate
    if direct:
        logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="vllm.declattn"):
        yield caplog
    if direct:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def cfg():
    """A fresh engine config (the plugin keys its state by config object)."""
    config = VllmConfig()
    yield config
    link.unregister(config)


@pytest.fixture
def v2_states(monkeypatch):
    """A real V2 ``RequestState`` on this CPU: vLLM's UVA check says yes here, but the
    machine has no pinned memory, so its device-memory fallback is used."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    states = RequestState(max_num_reqs=4, max_model_len=4096, max_num_batched_tokens=256,
                          num_speculative_steps=0, vocab_size=50_000,
                          device=torch.device("cpu"))
    return states, LogitsProcRequestState.from_request_state(states)


def _group(config, backend_name: str, window: int | None = None, n_layers: int = 2):
    """A KV-cache group as vLLM builds one: real attention layers (their impls store the
    backend's own window convention) registered in the config, and a builder of the
    backend's real class (initialised by its base class: its own ``__init__`` needs a GPU)."""
    from vllm.model_executor.layers.attention import Attention

    backend = {
        "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
        "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
        "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention:FlexAttentionBackend",
    }[backend_name]
    module, name = backend.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    start = len(config.compilation_config.static_forward_context)
    names = [f"model.layers.{start + i}.attn" for i in range(n_layers)]
    with set_current_vllm_config(config):
        layers = [Attention(4, 64, 0.125, num_kv_heads=2, prefix=n, attn_backend=cls,
                            per_layer_sliding_window=window) for n in names]
    common = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    spec = SlidingWindowSpec(sliding_window=window, **common) if window else \
        FullAttentionSpec(**common)
    patch.install()
    builder = cls.get_builder_cls().__new__(cls.get_builder_cls())
    AttentionMetadataBuilder.__init__(builder, spec, names, config, torch.device("cpu"))
    return builder, layers


def _common(lens, query_lens, req_idx=None, width=16):
    qsl = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    n = len(lens)
    table = torch.arange(1, 1 + width * n, dtype=torch.int32).reshape(n, width)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=int(seq.max()), block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(), is_prefilling=torch.zeros(n, dtype=torch.bool),
        req_idx=None if req_idx is None else np.asarray(req_idx),
    )


def _logits_context(slots, lens):
    """A V2 ``LogitsContext`` for one decode token per request: row i is slot ``slots[i]``."""
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    n, slots = len(slots), np.asarray(slots)
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(slots), idx_mapping=torch.tensor(slots),
        idx_mapping_np=slots, expanded_local_pos=torch.zeros(n, dtype=torch.int32),
        input_ids=torch.zeros(n, dtype=torch.int64), pos=torch.tensor(lens) - 1,
        seq_lens_upper_bound_np=np.array(lens))


# -- loading: both runners' real loaders ---------------------------------------------
def test_both_runners_load_the_plugin_and_neither_raises(cfg, v2_states) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample import logits_processor as v1
    from vllm.v1.worker.gpu.sample.logits_processor import loader as v2

    # the entry points, read at start-up by either runner (V2 used to stop here)
    assert DALogitsProcessor in v2._load_v2_logitsprocs_plugins()
    assert DALogitsProcessor in v1._load_logitsprocs_plugins()
    # by name (--logits-processors) and by type (LLM(logits_processors=[...]))
    for load in (v2._load_v2_logitsprocs_by_fqcns, v1._load_logitsprocs_by_fqcns):
        assert load([PROCESSOR_FQCN, DALogitsProcessor]) == [DALogitsProcessor] * 2
    # the front end's per-request validators of both runners
    bad = SamplingParams(extra_args={"da_prompt_len": 10, "da_chunks": [1]})
    check = v2.build_custom_logits_processors_params_validator([PROCESSOR_FQCN])
    check(SamplingParams())
    with pytest.raises(VLLMValidationError):
        check(bad)
    with pytest.raises(VLLMValidationError):
        v1.validate_logits_processors_parameters([PROCESSOR_FQCN], bad)
    # construction, as each runner does it: entry point first, then the named one
    states, _ = v2_states
    built = v2.build_custom_logits_processors(cfg, states, False, [PROCESSOR_FQCN])
    ours = [p for p in built if isinstance(p, V2DAProcessor)]
    assert [p.enabled for p in ours] == [True, False]  # one per engine; the second is inert
    link.unregister(cfg)
    v1_built = v1.build_logitsprocs(cfg, torch.device("cpu"), False, False, [PROCESSOR_FQCN])
    ours_v1 = [p for p in v1_built.all if isinstance(p, V1DAProcessor)]
    assert sorted(p.enabled for p in ours_v1) == [False, True]


def test_vllm_plugins_without_declattn_switches_it_off(cfg, smol_tokenizer, monkeypatch,
                                                        v2_states) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    req = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, OPTS)
    v1p = DALogitsProcessor(cfg, device=None, is_pin_memory=False)
    v1p.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                 added=[(0, SimpleNamespace(extra_args=req.extra_args), [], [])]))
    v2p = DALogitsProcessor(cfg, v2_states[1])
    assert not v2p.add_request(0, SamplingParams(extra_args=req.extra_args))
    assert v1p.rows == {} and v2p.state.rows == {} and v1p.is_argmax_invariant()
    assert link.lookup(cfg) is None


# -- V1: rows are batch rows ------------------------------------------------------------
def _update(size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added),
                       moved=list(moved))


def _labels(rows):
    return {row: t.spec.label for row, t in rows.items()}


def test_v1_rows_follow_adds_moves_swaps_and_replacements(cfg, smol_tokenizer) -> None:
    proc = DALogitsProcessor(cfg, device=None, is_pin_memory=False)
    assert isinstance(proc, V1DAProcessor) and link.lookup(cfg) is proc
    proc.state._tokenizer = smol_tokenizer
    a = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, OPTS, label="a")
    b = build_request(CONTEXT, "Boats on day 5?", smol_tokenizer, OPTS, label="b")

    def params(extra=None):
        return SimpleNamespace(extra_args=extra)

    proc.update_state(_update(3, added=[
        (0, params(a.extra_args), a.prompt_token_ids, []),
        (1, params(), [1, 2], []),  # plain: never tracked
        (2, params(b.extra_args), b.prompt_token_ids, []),
    ]))
    assert _labels(proc.rows) == {0: "a", 2: "b"}
    proc.update_state(_update(2, moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert _labels(proc.rows) == {0: "a", 1: "b"}
    proc.update_state(_update(2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert _labels(proc.rows) == {0: "b", 1: "a"}
    # a request added (or moved) onto a row replaces the one there, which has finished
    proc.update_state(_update(2, added=[(0, params(), [3], [])]))
    assert _labels(proc.rows) == {1: "a"}
    assert proc.reads("b") == []  # finished, still readable
    proc.update_state(_update(1, moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    proc.update_state(_update(0, removed=[0]))
    assert proc.rows == {}
    with pytest.raises(KeyError):
        proc.reads("nobody")


# -- V2: rows are slots -----------------------------------------------------------------
def test_v2_slots_drive_the_builder_and_the_logits(cfg, v2_states, smol_tokenizer) -> None:
    """One decode step of a V2 batch: batch rows hold slots 1 (plain), 3 (DA, forced into
    focus) and 0 (DA, global). The builder finds each tracker by slot, copies the newest
    tokens from the runner's device buffer, and compacts only the DA rows; the logits
    context maps rows to slots the same way."""

    states, lp_states = v2_states
    builder, _ = _group(cfg, "FLASH_ATTN")
    proc = DALogitsProcessor(cfg, lp_states)
    assert isinstance(proc, V2DAProcessor) and link.lookup(cfg) is proc
    proc.state._tokenizer = smol_tokenizer
    focus = smol_tokenizer.encode('<focus magic_chunks="2">\nDay', add_special_tokens=False)
    a = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, OPTS, force=[*focus, 11],
                      label="a")
    b = build_request(CONTEXT, "Boats on day 5?", smol_tokenizer, OPTS, label="b")
    assert proc.add_request(3, SamplingParams(extra_args=a.extra_args))  # forces: edits logits
    assert not proc.add_request(1, SamplingParams())
    assert not proc.add_request(0, SamplingParams(extra_args=b.extra_args))
    assert sorted(proc.state.rows) == [0, 3]
    # what the runner's post_update wrote: prompt, then each sampled token
    ids = states.all_token_ids.gpu
    out_a, out_b = list(focus), [smol_tokenizer.encode("Day", add_special_tokens=False)[0]]
    ids[3, : len(a.prompt_token_ids) + len(out_a)] = torch.tensor(a.prompt_token_ids + out_a)
    ids[0, : len(b.prompt_token_ids) + len(out_b)] = torch.tensor(b.prompt_token_ids + out_b)
    lens = [100, len(a.prompt_token_ids) + len(out_a), len(b.prompt_token_ids) + len(out_b)]
    cm = _common(lens, [1, 1, 1], req_idx=[1, 3, 0], width=64)
    new = patch._compact(builder, proc, cm)
    assert proc.tokens[3] == out_a and proc.tokens[0] == out_b  # copied from the device
    want_a = kept_for(a.layout, smol_tokenizer, out_a, lens[1], BLOCK)
    assert want_a[-1] == (lens[1] - 1) // BLOCK and len(want_a) < -(-lens[1] // BLOCK)
    assert new.block_table_tensor[1, : len(want_a)].tolist() == \
        cm.block_table_tensor[1, list(want_a)].tolist()
    n_b = -(-lens[2] // BLOCK)  # global: compacted to itself
    assert new.block_table_tensor[2, :n_b].tolist() == cm.block_table_tensor[2, :n_b].tolist()
    assert torch.equal(new.block_table_tensor[0], cm.block_table_tensor[0])  # plain row
    assert new.seq_lens[0] == 100 and new.seq_lens[2] == lens[2]
    (read,) = proc.reads("a")
    assert read.logical == want_a and read.physical == tuple(
        cm.block_table_tensor[1, list(want_a)].tolist())
    assert read.mode == "focus" and read.step == len(out_a)
    # the same step's logits: only slot 3's row is forced, to its next forced token
    ctx = _logits_context([1, 3, 0], lens)
    logits = torch.randn(3, 50_000)
    got = proc.apply(logits.clone(), ctx)
    assert int(got[1].argmax()) == 11 and torch.isinf(got[1]).sum() == 50_000 - 1
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    # V2 recycles a slot with no removal call: the next occupant's add replaces a
    assert not proc.add_request(3, SamplingParams())
    assert sorted(proc.state.rows) == [0] and len(proc.reads("a")) == 1
    report = proc.report("a")
    assert report.reads_restricted is True and report.decode_steps == 1


# -- the builder wrapper's control flow --------------------------------------------------
def test_wrapper_hands_the_stock_build_compacted_metadata_only_for_da_decode_rows(
        cfg, smol_tokenizer) -> None:
    builder, _ = _group(cfg, "TRITON_ATTN")
    calls = []

    def build(self, common_prefix_len, cm, fast_build=False):
        calls.append((common_prefix_len, cm))
        return "metadata"

    wrapped = patch._wrap(build)
    proc = DALogitsProcessor(cfg, device=None, is_pin_memory=False)
    proc.state._tokenizer = smol_tokenizer
    req = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, OPTS, label="r")
    live: list[int] = []
    proc.update_state(_update(3, added=[
        (0, SimpleNamespace(extra_args=req.extra_args), [], []),  # DA, prefilling
        (1, SimpleNamespace(extra_args=req.extra_args), [], live),  # DA, decoding
    ]))
    live.extend(smol_tokenizer.encode("<local>", add_special_tokens=False))
    n = len(req.prompt_token_ids) + len(live)
    cm = _common([60, n, 90], [5, 1, 1], width=64)
    table, lens = cm.block_table_tensor.clone(), cm.seq_lens.clone()
    assert wrapped(builder, 64, cm) == "metadata"
    prefix, new = calls[-1]
    assert prefix == 0  # no cascade attention over compacted rows
    assert torch.equal(cm.block_table_tensor, table) and torch.equal(cm.seq_lens, lens)
    want = kept_for(req.layout, smol_tokenizer, live, n, BLOCK)
    assert new.block_table_tensor[1, : len(want)].tolist() == table[1, list(want)].tolist()
    assert len(want) < -(-n // BLOCK)  # local mode: blocks were skipped
    for row in (0, 2):  # the prefill row and the plain row are as they were
        assert torch.equal(new.block_table_tensor[row], table[row])
        assert new.seq_lens[row].item() == lens[row].item()
    assert new.max_seq_len == max(90, int(new.seq_lens[1]))
    # without a processor for this engine the stock build gets the very same arguments
    link.unregister(cfg)
    assert wrapped(builder, 64, cm) == "metadata" and calls[-1] == (64, cm)


# -- eligibility and refusals -------------------------------------------------------------
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_window_minus_one_minus_one_groups_qualify_and_windowed_ones_do_not(cfg,
                                                                            backend) -> None:
    builder, layers = _group(cfg, backend)
    assert all(layer.impl.sliding_window == (-1, -1) for layer in layers)  # the backend's own
    assert support.group_verdict(builder).ok
    windowed, layers = _group(cfg, backend, window=512)
    assert all(layer.impl.sliding_window == (511, 0) for layer in layers)
    verdict = support.group_verdict(windowed)
    assert not verdict.ok and verdict.by_design


def test_an_unwrapped_backend_is_refused_by_name(cfg) -> None:
    builder, _ = _group(cfg, "FLEX_ATTENTION")
    verdict = support.group_verdict(builder)
    assert not verdict.ok and not verdict.by_design and "TRITON_ATTN" in verdict.fix
    (blocker,) = support.engine_blockers(cfg, support.V2)
    assert "FLEX_ATTENTION" in blocker.reason and "TRITON_ATTN" in blocker.fix


def test_full_cuda_graphs_are_flagged_and_no_step_is_recorded_as_skipped(
        cfg, v2_states, smol_tokenizer, declattn_log) -> None:
    builder, _ = _group(cfg, "FLASH_ATTN")
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's default
    (blocker,) = support.engine_blockers(cfg, support.V2)
    assert "full CUDA graphs" in blocker.reason and "cudagraph_mode=PIECEWISE" in blocker.fix
    states, lp_states = v2_states
    proc = DALogitsProcessor(cfg, lp_states)
    proc.state._tokenizer = smol_tokenizer
    req = build_request(CONTEXT, "Boats on day 2?", smol_tokenizer, OPTS, label="g")
    proc.add_request(2, SamplingParams(extra_args=req.extra_args))
    proc.add_request(1, SamplingParams(extra_args=req.extra_args))  # warned once only
    warnings = [r for r in declattn_log.records if "full CUDA graphs" in r.getMessage()]
    assert len(warnings) == 1 and "PIECEWISE" in warnings[0].getMessage()
    n = len(req.prompt_token_ids) + 1
    states.all_token_ids.gpu[2, :n] = torch.tensor(req.prompt_token_ids + [11])
    assert patch._compact(builder, proc, _common([n], [1], req_idx=[2], width=64)) is None
    report = proc.report("g")
    assert report.reads_restricted is False and report.reads == []
    assert "full CUDA graphs" in report.blockers[0]
    # piecewise graphs run attention eagerly: nothing blocks there
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert support.engine_blockers(cfg, support.V2) == []


def test_features_that_stop_skipping_each_name_their_fix(cfg) -> None:
    cfg.scheduler_config.async_scheduling = True
    (v1_async,) = support.engine_blockers(cfg, support.V1)
    assert "async scheduling" in v1_async.reason and "--no-async-scheduling" in v1_async.fix
    assert support.engine_blockers(cfg, support.V2) == []  # V2 copies the token: it works
    assert any("async" in n for n in support.engine_notes(cfg, support.V2))
    cfg.scheduler_config.async_scheduling = False
    cfg.speculative_config = SimpleNamespace(method="ngram")
    cfg.parallel_config.pipeline_parallel_size = 2
    reasons = [b.reason for b in support.engine_blockers(cfg, support.V2)]
    assert any("speculative" in r for r in reasons) and any("pipeline" in r for r in reasons)
    cfg.parallel_config.pipeline_parallel_size = 1
    cfg.speculative_config = None


def test_speculative_decoding_without_a_processor_is_warned(declattn_log) -> None:
    config = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))
    patch._check_unattached(config)
    patch._check_unattached(config)  # once per engine
    (record,) = [r for r in declattn_log.records if "speculative" in r.getMessage()]
    assert "run as plain requests" in record.getMessage()


def test_the_doctors_verdict_names_every_cause() -> None:
    from declattn.vllm.doctor import DoctorReport, GroupLine, WorkerReport

    def worker(**over):
        group = GroupLine(0, "FLASH_ATTN", "FlashAttentionMetadataBuilder", 24,
                          "FullAttentionSpec", 16, True, "", "", False, 10, 40, 100)
        fields = dict(rank=0, runner="v2", processor=True, cudagraph_mode="PIECEWISE",
                      async_scheduling=False, tensor_parallel=1, groups=[group],
                      blockers=[], notes=[], probe={"reads_restricted": True})
        return WorkerReport(**{**fields, **over})

    assert DoctorReport("0.32.0", "m", {}, [worker()]).active
    graphs = {"reason": "full CUDA graphs (cudagraph_mode=FULL_AND_PIECEWISE): ...",
              "fix": support.FIX_GRAPHS}
    blocked = DoctorReport("0.32.0", "m", {}, [worker(blockers=[graphs])])
    assert not blocked.active and "cudagraph_mode=PIECEWISE" in blocked.verdict()
    missing = DoctorReport("0.32.0", "m", {}, [worker(processor=False, probe=None)])
    assert not missing.active and "no DA logits processor" in missing.verdict()


# -- the find focus and the streaming baseline --------------------------------------------
FIND = DAOptions(target=64, cap=96, focus="find")


def test_v1_hands_a_da_request_its_prompts_chunk_spans_and_warns_without_them(
        cfg, smol_tokenizer, declattn_log) -> None:
    from declattn.vllm.tracker import chunk_ids_of

    proc = DALogitsProcessor(cfg, device=None, is_pin_memory=False)
    proc.state._tokenizer = smol_tokenizer
    req = build_request(CONTEXT, "Boats on day 7?", smol_tokenizer, FIND, label="f")
    args = SimpleNamespace(extra_args=req.extra_args)
    proc.update_state(_update(2, added=[(0, args, req.prompt_token_ids, []),
                                        (1, args, req.prompt_token_ids[1:], [])]))
    assert proc.rows[0].chunk_ids == chunk_ids_of(req.prompt_token_ids, req.layout)
    assert proc.rows[1].wants_chunks  # a prompt its layout does not describe
    (warning,) = [r for r in declattn_log.records if "find declarations" in r.getMessage()]
    assert "declined" in warning.getMessage()


def test_v2_copies_the_chunk_spans_from_the_device_and_a_find_focus_reads_its_chunk(
        cfg, v2_states, smol_tokenizer) -> None:
    """One V2 decode step with a DA request forced into a find focus (slot 2, find
    constraint on) and a StreamingLLM request (slot 0): the chunk spans come from the
    runner's device buffer with the newest tokens, in the one gather; the find focus
    reads the chunk its phrase names; the streaming row reads its budget, and none of
    its tokens are copied."""
    import dataclasses

    from declattn.da.constrain_find import FindConstraint
    from declattn.da.scope import Scope
    from declattn.eval.baselines import streaming_view
    from declattn.protocol.modes import Mode
    from declattn.vllm.tracker import chunk_ids_of
    from declattn.vllm.xargs import StreamingSpec

    states, lp_states = v2_states
    builder, _ = _group(cfg, "FLASH_ATTN")
    proc = DALogitsProcessor(cfg, lp_states)
    proc.state._tokenizer = smol_tokenizer
    options = dataclasses.replace(FIND, constrain=True)
    req = build_request(CONTEXT, "Boats on day 7?", smol_tokenizer, options, label="f")
    chunk = 3
    phrase = naming_phrase([c.text for c in req.chunks], chunk)
    out = smol_tokenizer.encode(f'<focus find="{phrase}">\nDay', add_special_tokens=False)
    stream = StreamingSpec(prompt_len=400, budget=6, sink_tokens=16, label="s")
    assert proc.add_request(2, SamplingParams(extra_args=req.extra_args))  # constrained
    assert not proc.add_request(0, SamplingParams(extra_args=stream.to_args()))
    tracker = proc.state.rows[2]
    assert tracker.wants_chunks and 0 not in proc.tokens  # streaming needs no token
    prompt = req.prompt_token_ids
    n = len(prompt) + len(out)
    states.all_token_ids.gpu[2, :n] = torch.tensor(prompt + out)
    lens = [n, 400 + 37]
    cm = _common(lens, [1, 1], req_idx=[2, 0], width=64)
    new = patch._compact(builder, proc, cm)
    assert tracker.chunk_ids == chunk_ids_of(prompt, req.layout) and not tracker.wants_chunks
    assert proc.tokens[2] == out
    (read,) = proc.reads("f")
    want = tuple(Scope(req.layout, Mode.FOCUS, (chunk,)).kept_blocks(n, BLOCK))
    assert (read.mode, read.focus_ids, read.logical) == ("focus", (chunk,), want)
    assert len(want) < -(-n // BLOCK)
    assert new.block_table_tensor[0, : len(want)].tolist() == \
        cm.block_table_tensor[0, list(want)].tolist()
    (sread,) = proc.reads("s")
    kept = tuple(streaming_view(-(-lens[1] // BLOCK), 6, 1))
    assert sread.logical == kept and len(kept) == 6
    assert new.block_table_tensor[1, :6].tolist() == cm.block_table_tensor[1, list(kept)].tolist()
    assert int(new.seq_lens[1]) == 5 * BLOCK + (lens[1] - (lens[1] - 1) // BLOCK * BLOCK)
    # the engine core built the find constraint; outside a find tag it leaves a row alone
    assert [type(c) for c in tracker.state.constraints] == [FindConstraint]
    ctx = _logits_context([2, 0], lens)
    logits = torch.randn(2, 50_000)
    assert torch.equal(proc.apply(logits.clone(), ctx), logits)
