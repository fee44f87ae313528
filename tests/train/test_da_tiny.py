"""``da-tiny``, the model shipped inside declattn, end to end through the real engine:
fast enough for every test run, and trained to declare, so DA runs from its own tags.

Fresh documents (seeds training never drew): it answers right, reads less than vanilla,
the read counter equals the scope on every decode step, and forcing its focus onto a
chunk without the fact makes it wrong (the answer comes from what focus reads). Last,
the curriculum that trained it: chunk counts held then grown, and unmasked sequences."""

from __future__ import annotations

import random
from typing import Any

import pytest

from declattn.api import Engine
from declattn.engine.registry import MODELS, resolve_model
from declattn.engine.sampler import SamplingParams
from declattn.protocol.modes import Mode
from declattn.train.evaluate import EVAL_SEED_BASE, run_cell
from declattn.train.tasks import make_episode


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("da-tiny", dtype="fp32")


def test_it_ships_inside_the_package() -> None:
    path = resolve_model("da-tiny")
    assert MODELS["da-tiny"].installed() and (path / "model.safetensors").is_file()
    assert (path / "declattn.json").is_file() and (path / "training.json").is_file()


def test_it_answers_from_its_own_declarations(engine: Engine) -> None:
    rng = random.Random(EVAL_SEED_BASE + 5)
    right = on_evidence = 0
    for _ in range(10):
        ep = make_episode(rng, 16, False)
        ans = engine.answer(ep.context, ep.question, max_tokens=64)
        right += ans.answer == ep.answer
        accepted = [d for d in ans.declarations if d.accepted]
        kinds = ["global", "/global", "focus", "/focus", "answer", "/answer"]
        assert [d.kind for d in accepted] == kinds
        on_evidence += accepted[2].focus_ids == ep.evidence_chunks
        s = ans.stats
        assert s.logical_attended < s.vanilla_attended  # its focus really read less
    assert right >= 8 and on_evidence >= 8


def test_the_read_counter_equals_the_scope_on_every_step(engine: Engine) -> None:
    ep = make_episode(random.Random(EVAL_SEED_BASE + 9), 16, False)
    sess = engine.session(ep.context, ep.question, da=True, max_tokens=64)
    seq = engine.add(sess, SamplingParams(max_tokens=64))
    for _ in engine.run(seq):
        pass
    assert len(seq.reads) == len(sess.expected_views) > 0
    for read, expected in zip(seq.reads, sess.expected_views, strict=True):
        assert read.blocks == expected and read.layers_agree
    focus = [s for s in sess.steps if s.mode is Mode.FOCUS]
    assert focus and all(s.logical < s.vanilla_logical / 3 for s in focus)


@pytest.mark.parametrize("arm, low, high", [("da", 0.8, 1.0), ("wrong", 0.0, 0.2)])
def test_forcing_the_wrong_chunk_collapses_accuracy(engine: Engine, arm: str, low: float,
                                                   high: float) -> None:
    cell = run_cell(engine, 16, False, arm, 20, seed=3)
    assert low <= cell.accuracy <= high, cell


def test_demo_runs_the_whole_loop(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """It says how many threads it chose (its timings depend on it)."""
    import torch

    from declattn.cli import main

    before = torch.get_num_threads()
    try:
        assert main(["demo", "--model", "da-tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    text = " ".join(capsys.readouterr().out.split())
    assert "torch threads: 1 of" in text
    assert "generated paragraphs" in text and "held the fact: yes" in text
    assert "per answer, DA read" in text and "the plain answer's attended tokens" in text
    assert main(["demo", "--model", "da-tiny", "--threads", "0"]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_the_curriculum_holds_short_documents_then_grows(tiny_tok: Any) -> None:
    from declattn.train.da_tiny import Curriculum, TinySpec

    spec = TinySpec(steps=100, hold_chunks=3, hold=0.5, curriculum=0.8, max_chunks=16)
    top = [Curriculum(spec, tiny_tok).max_chunks(step) for step in range(100)]
    assert set(top[:50]) == {3} and set(top[80:]) == {16}
    assert top[50:80] == sorted(top[50:80]) and 3 < top[65] < 16


@pytest.mark.parametrize("unmasked", [0.0, 1.0])
def test_unmasked_sequences_are_plainly_causal(tiny_tok: Any, unmasked: float) -> None:
    import torch

    from declattn.train.da_tiny import Curriculum, TinySpec

    ex = Curriculum(TinySpec(unmasked=unmasked), tiny_tok).example(4)
    causal = torch.ones_like(ex.mask).tril()
    assert torch.equal(ex.mask, causal) == (unmasked == 1.0)
