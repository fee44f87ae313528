"""The StreamingLLM baseline as a vLLM request, and the arms ``eval --backend vllm`` runs,
without vLLM."""

from __future__ import annotations

import pytest
import torch

from declattn.eval.arms import ARMS
from declattn.eval.baselines import StreamingSession
from declattn.vllm.eval_backend import ARMS as VLLM_ARMS
from declattn.vllm.eval_backend import UnsupportedArm, check_arms
from declattn.vllm.streaming import StreamingTracker
from declattn.vllm.xargs import BadDAArgs, StreamingSpec, parse


def test_a_streaming_request_round_trips_through_flat_args() -> None:
    spec = StreamingSpec(prompt_len=300, budget=5, sink_tokens=16, label="s")
    args = spec.to_args()
    assert all(isinstance(v, int | str) or all(isinstance(x, int) for x in v)
               for v in args.values())
    assert parse(args) == spec
    for bad in ({"da_streaming": 0}, {"da_streaming": "five"}, {"da_prompt_len": 0},
                {"da_sink": [0]}):
        with pytest.raises(BadDAArgs):
            parse({**args, **bad})


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_tracker_keeps_what_our_engines_streaming_session_reads(block_size) -> None:
    spec = StreamingSpec(prompt_len=300, budget=5, sink_tokens=16, label="s")
    tracker = StreamingTracker(spec)
    sess = StreamingSession(list(range(300)), block_size, 5, 16)
    assert not tracker.follows_output and not tracker.edits_logits and tracker.masking
    for length in range(300, 420, 7):
        kept = tracker.kept_blocks(length, block_size)
        assert kept == tuple(sess.view(length))
        assert len(kept) == 5 and kept[-1] == (length - 1) // block_size
    kept = tracker.kept_blocks(350, block_size)
    tracker.record(350, kept, torch.tensor(kept), 0, 0, 0, block_size)
    (read,) = tracker.reads
    assert read.mode == "streaming" and read.step == 50 and read.kept == read.logical == kept
    row = torch.randn(10)
    assert tracker.process_logits(row) is row


def test_eval_backend_runs_every_arm_it_can_and_says_why_not_the_others() -> None:
    refused = {"quest", "da-model", "da-model-wrong"}
    assert set(VLLM_ARMS) == set(ARMS) - refused
    check_arms([a for a in ARMS if a not in refused])
    with pytest.raises(UnsupportedArm, match="da-model-wrong: the forced-wrong-chunk"):
        check_arms(["da-model-wrong"])
    with pytest.raises(UnsupportedArm, match="quest: Quest picks each step's blocks"):
        check_arms(["da", "quest"])
    with pytest.raises(UnsupportedArm, match="unknown arm"):
        check_arms(["oracle"])


def test_a_streaming_row_without_its_budget_row_is_an_error_row(smol_tokenizer, tmp_path) -> None:
    """As in the engine backend: no budget arm row, or a failed one, gives the streaming
    arm an error row saying so (no model runs for it)."""
    import json

    from declattn.eval.arms import ArmSettings
    from declattn.eval.rows import error_row
    from declattn.eval.runner import EvalSpec
    from declattn.eval.tasks import TaskData, generate
    from declattn.vllm.eval_backend import run_eval_vllm
    from declattn.vllm.offline import ServedModel

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    served = ServedModel(tmp_path, smol_tokenizer)
    spec = EvalSpec(model="m", tasks=["vt"], lengths=[400], arms=["da", "streaming"],
                    samples=1, settings=ArmSettings(max_tokens=16))
    sample = generate("vt", TaskData.for_tokenizer(smol_tokenizer), 400, spec.seed)
    out = tmp_path / "results.jsonl"
    out.write_text(json.dumps(error_row("m", sample, 0, "da", "it broke", {})) + "\n")
    rows = run_eval_vllm(spec, out, machine={}, served=served)
    assert [r["arm"] for r in rows] == ["da", "streaming"]
    assert rows[1]["error"] == "no budget: the da arm failed"
    assert len(out.read_text().splitlines()) == 2  # written, so a rerun resumes
