"""Processes sharing a disk tier: one killed mid-write leaves nothing that is ever read as
K/V; two writing the same document at once both answer right and leave one valid copy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from disk_world import chunk_files, engine, run
from tiny_world import prompt, tiny_model

from declattn.engine.controller import Controller
from declattn.engine.kvdisk.atomic import TMP_PREFIX
from declattn.engine.kvdisk.chunkfile import ChunkMeta, read_chunk, read_header
from declattn.engine.kvdisk.store import scan

HERE = Path(__file__).parent
SRC = Path(__file__).parents[3] / "src"
DOC = prompt(300, 1) + prompt(20, 2)

CHILD = """
import json, os, sys, time
from pathlib import Path
root, mode, signal_file = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
if mode == "pause-in-fsync":  # the first chunk's bytes are written, not yet renamed
    def fsync(fd):
        signal_file.write_text("writing")
        time.sleep(120)
    os.fsync = fsync
from disk_world import engine, run
from tiny_world import prompt, tiny_model
from declattn.engine.controller import Controller
if mode == "together":  # both children start their prefill at the same moment
    signal_file.with_suffix(f".ready{os.getpid()}").write_text("")
    while not signal_file.exists():
        time.sleep(0.001)
doc = prompt(300, 1) + prompt(20, 2)
seq, logits = run(engine(tiny_model(seed=4), root), Controller(doc))
print(json.dumps({"out": seq.output_ids, "logits": [l.tolist() for l in logits],
                  "disk": seq.disk_tokens}))
"""


def _child(root: Path, mode: str, signal_file: Path) -> subprocess.Popen[str]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(SRC), str(HERE.parent), str(HERE)]),
                        "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, str(signal_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the child never got there"
        time.sleep(0.01)


def _check_every_file(root: Path) -> None:
    """Every chunk file reads back whole against its own header."""
    for p in chunk_files(root):
        m = read_header(p)
        want = ChunkMeta(m.namespace, m.digest, m.parent, m.index, m.tokens)
        read_chunk(p, want, (2, 2, 64, 16), torch.float32)


def test_a_process_killed_while_writing_leaves_nothing_read_as_kv(tmp_path: Path) -> None:
    root, flag = tmp_path / "kv", tmp_path / "flag"
    child = _child(root, "pause-in-fsync", flag)
    _wait_for(flag, child)
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = [p for p in root.glob("*/*") if p.name.startswith(TMP_PREFIX)]
    assert len(left) == 1 and left[0].stat().st_size > 0  # the killed write
    assert chunk_files(root) == []  # nothing under a name a reader opens
    model = tiny_model(seed=4)
    _, ref = run(engine(model, None, caching=False), Controller(DOC))
    seq, logits = run(engine(model, root), Controller(DOC))
    assert seq.cached_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(logits, ref, strict=True))
    assert scan(root).junk == left  # its writer is dead: the next sweep removes it
    _check_every_file(root)


def test_two_processes_writing_one_document_both_answer_right(tmp_path: Path) -> None:
    root, go = tmp_path / "kv", tmp_path / "go"
    children = [_child(root, "together", go) for _ in range(2)]
    for c in children:
        deadline = time.monotonic() + 120
        while not any(p.suffix == f".ready{c.pid}" for p in tmp_path.iterdir()):
            assert c.poll() is None, c.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.01)
    go.write_text("go")
    results = []
    for c in children:
        out, err = c.communicate(timeout=300)
        assert c.returncode == 0, err
        results.append(json.loads(out))
    model = tiny_model(seed=4)
    ref_seq, ref = run(engine(model, None, caching=False), Controller(DOC))
    for r in results:
        assert r["out"] == ref_seq.output_ids
        assert torch.equal(torch.tensor(r["logits"]), torch.stack(ref))
    assert len(chunk_files(root)) == 5  # one copy of each whole chunk
    assert not [p for p in root.glob("*/*") if p.name.startswith(TMP_PREFIX)]
    _check_every_file(root)
