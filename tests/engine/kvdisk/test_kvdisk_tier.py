"""The disk tier in the engine: a prefix read from disk gives a fresh prefill's logits bit
for bit (fp32), in whole prefill chunks; what it cannot use it misses, never mismatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from disk_world import CHUNK, chunk_files, engine, run
from tiny_world import prompt, tiny_model

from declattn.engine.controller import Controller


class Narrow(Controller):
    """A DA-like view: the first and last blocks only."""

    def view(self, length: int) -> list[int]:
        return sorted({0, (length - 1) // 16})


@pytest.mark.parametrize("cls", [Controller, Narrow])
def test_a_prefix_from_disk_gives_a_fresh_prefills_logits(tmp_path: Path, cls: type) -> None:
    model = tiny_model(seed=4)
    doc = prompt(300, 1)
    q1, q2 = doc + prompt(20, 2), doc + prompt(25, 3)
    ref_seq, ref = run(engine(model, None, caching=False), cls(q2))
    first, _ = run(engine(model, tmp_path), cls(q1))
    assert first.cached_tokens == first.disk_tokens == 0
    assert len(chunk_files(tmp_path)) == 320 // CHUNK  # every whole chunk of q1's prompt
    seq, logits = run(engine(model, tmp_path), cls(q2))  # a new engine: nothing in memory
    assert seq.cached_tokens == seq.disk_tokens == 256  # whole chunks below the last token
    assert all(torch.equal(a, b) for a, b in zip(logits, ref, strict=True))
    assert seq.output_ids == ref_seq.output_ids
    assert [r.blocks for r in seq.reads] == [r.blocks for r in ref_seq.reads]


def test_memory_first_then_disk_and_read_chunks_join_the_memory_cache(tmp_path: Path) -> None:
    model = tiny_model(seed=5)
    doc = prompt(400, 4)
    run(engine(model, tmp_path), Controller(doc + prompt(9, 5)))
    eng = engine(model, tmp_path)
    run(eng, Controller(doc[:200] + prompt(30, 6)))  # memory now holds chunks 0-2
    seq, logits = run(eng, Controller(doc + prompt(12, 7)))
    assert seq.cached_tokens == 384 and seq.disk_tokens == 384 - 192
    _, ref = run(engine(model, None, caching=False), Controller(doc + prompt(12, 7)))
    assert torch.equal(logits[0], ref[0])
    again, _ = run(eng, Controller(doc + prompt(14, 8)))
    assert again.cached_tokens == 384 and again.disk_tokens == 0  # from memory now


def test_another_model_misses(tmp_path: Path) -> None:
    doc = prompt(300, 1)
    run(engine(tiny_model(seed=4), tmp_path), Controller(doc + prompt(5, 2)))
    other, _ = run(engine(tiny_model(seed=5), tmp_path), Controller(doc + prompt(5, 3)))
    assert other.cached_tokens == 0
    assert len({p.parent for p in chunk_files(tmp_path)}) == 2  # one namespace each


def test_no_prefix_caching_means_no_disk_tier(tmp_path: Path) -> None:
    eng = engine(tiny_model(seed=4), tmp_path, caching=False)
    assert eng.disk is None
    run(eng, Controller(prompt(300, 1)))
    assert chunk_files(tmp_path) == []
