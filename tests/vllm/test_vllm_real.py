"""DA on a real vLLM (a CPU build of vLLM 0.32), against our own engine.

One vLLM engine runs in this process with the plugin; a second, in a child process with
the plugin switched off (``VLLM_PLUGINS=""``), runs the same batch as the reference for
"untouched". Both use fp32 and block size 32, as does our engine here, so greedy outputs
can be compared token for token.

Skipped where vLLM is not installed (the main virtual environment); ``make test`` runs
this module in the vLLM one (.venv-vllm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.sample.logits_processor")  # a real vLLM, not this folder

from declattn.vllm.offline import offline_env  # noqa: E402

offline_env()

import torch  # noqa: E402

from declattn.api import Engine  # noqa: E402
from declattn.engine.sampler import SamplingParams as EngineParams  # noqa: E402
from declattn.protocol.modes import Mode  # noqa: E402
from declattn.protocol.prompt import render_plain  # noqa: E402
from declattn.replay import replay  # noqa: E402
from declattn.scope import Scope  # noqa: E402
from declattn.session import DAOptions  # noqa: E402
from declattn.vllm import build_request, link  # noqa: E402
from declattn.vllm.compact import compacted_length  # noqa: E402
from declattn.vllm.offline import make_llm, output_record  # noqa: E402

BLOCK = 32
MAX_TOKENS = 32
OPTIONS = DAOptions(target=128, cap=192, constrain=True, runaway=False)
QUESTION = "What is the essay about?"
OTHER_QUESTION = "Who is the keeper of the lighthouse?"
FORCED_PREFIX = '<focus magic_chunks="3">\nThe'
ESSAY = Path(__file__).resolve().parents[2] / "src" / "declattn" / "data" / "sample_essay.txt"


class Forced:
    """Our engine's controller for a teacher-forced DA request: the session, plus the
    same forcing the plugin applies (forced tokens win over the focus constraint)."""

    def __init__(self, session: Any, force: list[int]) -> None:
        self.session = session
        self.force = force

    def view(self, length: int) -> Any:
        return self.session.view(length)

    def on_token(self, token_id: int, text: str) -> str | None:
        return self.session.on_token(token_id, text)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = self.session.process_logits(logits)
        k = self.session.n_tokens
        if k < len(self.force):
            out = torch.full_like(logits, float("-inf"))
            out[self.force[k]] = 0.0
            return out
        return logits


def _engine_run(engine: Engine, context: str, force: list[int]) -> tuple[list[int], Any, Any]:
    sess = engine.session(context, QUESTION, options=OPTIONS, max_tokens=MAX_TOKENS)
    seq = engine.core.add(sess.prompt_ids, EngineParams(max_tokens=MAX_TOKENS), Forced(sess, force))
    for _ in engine.core.run(seq):
        pass
    return list(seq.output_ids), sess, seq


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("smollm2-135m", dtype="fp32", block_size=BLOCK)


@pytest.fixture(scope="module")
def context() -> str:
    return ESSAY.read_text(encoding="utf-8")[:3000]


@pytest.fixture(scope="module")
def batch(engine: Engine, context: str) -> dict[str, dict[str, Any]]:
    """The mixed batch, by name: two DA requests (teacher-forced, free) and two plain
    ones (the vanilla prompt, and the DA prompt without DA args)."""
    tok = engine.tokenizer
    force = tok.encode(FORCED_PREFIX, add_special_tokens=False)
    forced = build_request(context, QUESTION, tok, OPTIONS, force=force, label="forced")
    free = build_request(context, QUESTION, tok, OPTIONS, label="free")
    # Every request runs exactly MAX_TOKENS steps, with or without the plugin, so both
    # runs see the same batch shapes at every step (a batch of another shape may round
    # a float differently, which is not what "untouched" is about).
    base = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, "ignore_eos": True}
    return {
        "forced": {"prompt_token_ids": forced.prompt_token_ids,
                   "params": {**base, "extra_args": forced.extra_args}, "force": force},
        "plain": {"prompt_token_ids": render_plain(tok, context, OTHER_QUESTION),
                  "params": dict(base)},
        "free": {"prompt_token_ids": free.prompt_token_ids,
                 "params": {**base, "extra_args": free.extra_args}},
        "free_as_plain": {"prompt_token_ids": free.prompt_token_ids, "params": dict(base)},
    }


@pytest.fixture(scope="module")
def unplugged(engine: Engine, batch: dict, tmp_path_factory: pytest.TempPathFactory):
    """The same batch in a child process with the plugin off; started early, read late."""
    tmp = tmp_path_factory.mktemp("unplugged")
    spec = {
        "model": str(engine.loaded.weights_dir),
        "llm": {"block_size": BLOCK},
        "requests": [{k: v for k, v in r.items() if k != "force"} for r in batch.values()],
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "declattn.vllm.offline", str(tmp / "spec.json"),
         str(tmp / "out.json")],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "log.txt", "w"),  # noqa: SIM115
    )

    def result() -> dict[str, dict[str, Any]]:
        rc = proc.wait(timeout=600)
        assert rc == 0, (tmp / "log.txt").read_text()[-3000:]
        outs = json.loads((tmp / "out.json").read_text())
        return dict(zip(batch, outs, strict=True))

    yield result
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def served(engine: Engine, tmp_path_factory: pytest.TempPathFactory):
    """vLLM's OpenAI-compatible server with the plugin from its entry points: the engine
    core runs in its own process there, where the builder patch must be installed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("served") / "log.txt", "w+")  # noqa: SIM115
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(engine.loaded.weights_dir), "--served-model-name", "smol",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--block-size", str(BLOCK), "--enforce-eager", "--no-async-scheduling",
         "--no-enable-prefix-caching", "--max-model-len", "4096"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )

    def post(body: dict[str, Any]) -> dict[str, Any]:
        import time

        import httpx

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, _tail(log)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, _tail(log)
            time.sleep(2)
        return httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()

    yield post
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _tail(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


@pytest.fixture(scope="module")
def plugged(engine: Engine, batch: dict, unplugged, served) -> dict[str, Any]:
    """The batch through vLLM with the plugin, in one ``generate`` call."""
    from vllm import SamplingParams

    llm = make_llm(engine.loaded.weights_dir, block_size=BLOCK)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch.values()]
    params = [SamplingParams(**r["params"]) for r in batch.values()]
    outs = llm.generate(prompts, params, use_tqdm=False)
    (processor,) = [p for p in link.processors() if p.enabled]
    result: dict[str, Any] = dict(zip(batch, map(output_record, outs), strict=True))
    result["reads"] = {name: processor.reads(name) for name in ("forced", "free")}
    return result


def test_teacher_forced_da_output_equals_our_engine(engine, context, batch, plugged) -> None:
    ids, sess, _ = _engine_run(engine, context, batch["forced"]["force"])
    # our engine stops at end of sequence, vLLM runs on (ignore_eos): compare what ours wrote
    assert plugged["forced"]["token_ids"][: len(ids)] == ids
    assert len(ids) > len(batch["forced"]["force"]) + 8  # a free continuation was compared
    # ...and that continuation was read under the focus scope, with blocks skipped
    reads = plugged["reads"]["forced"]
    focus = [r for r in reads if r.mode == Mode.FOCUS]
    assert focus and all(len(r.physical) < -(-r.length // BLOCK) for r in focus)
    views = list(sess.expected_views)
    assert [r.logical for r in reads[: len(views)]] == views


def test_free_da_output_equals_our_engine(engine, context, plugged) -> None:
    ids, _, _ = _engine_run(engine, context, [])
    assert len(ids) > 8
    assert plugged["free"]["token_ids"][: len(ids)] == ids


def test_blocks_handed_to_the_kernel_are_the_scopes_kept_blocks(engine, batch, plugged) -> None:
    """The builder's counter, held against a scope rebuilt from the output alone."""
    out = plugged["forced"]
    spec_layout = build_request_layout(batch["forced"])
    reads = plugged["reads"]["forced"]
    n_out = len(out["token_ids"])
    assert [r.step for r in reads] == list(range(1, n_out))  # every decode step, once
    texts = _token_texts(engine.tokenizer, out["token_ids"])
    steps = replay(spec_layout, texts, block_size=BLOCK).steps
    for r, step in zip(reads, steps, strict=True):
        expected = tuple(Scope(spec_layout, step.mode, step.focus_ids).kept_blocks(r.length, BLOCK))
        assert r.length == spec_layout.prompt_len + r.step
        assert r.kept == r.logical == expected
        assert len(set(r.physical)) == len(r.physical) == len(expected)
        assert r.seq_len == compacted_length(r.length, len(expected), BLOCK)


def test_all_global_da_request_equals_vanilla_vllm(batch, plugged, unplugged) -> None:
    reads = plugged["reads"]["free"]
    assert reads and all(r.mode == Mode.GLOBAL for r in reads)
    vanilla = unplugged()["free"]  # the same request on vLLM without the plugin
    assert plugged["free"] == vanilla  # token ids, text, and every logprob
    assert plugged["free"]["token_ids"] == plugged["free_as_plain"]["token_ids"]


def test_plain_requests_in_a_mixed_batch_are_untouched(plugged, unplugged) -> None:
    reference = unplugged()
    for name in ("plain", "free_as_plain"):
        assert plugged[name] == reference[name]  # token ids, text, and every logprob
    # the DA request did change: its focus continuation is another text without the plugin
    assert plugged["forced"]["token_ids"] != reference["forced"]["token_ids"]


def build_request_layout(entry: dict[str, Any]) -> Any:
    from declattn.vllm.xargs import parse

    spec = parse(entry["params"]["extra_args"])
    assert spec is not None
    return spec.layout


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    from declattn.engine.detok import Detokenizer

    detok = Detokenizer(tokenizer)
    return [detok.add(t) for t in ids]


def test_vllm_server_with_the_entry_points_runs_da(batch, plugged, served) -> None:
    """``vllm serve`` (its API server module) with declattn installed: no flag needed, the
    DA args travel in ``vllm_xargs``, and the response is the in-process DA response."""
    forced = batch["forced"]
    params = {k: v for k, v in forced["params"].items() if k not in ("extra_args", "logprobs")}
    body = {"model": "smol", "prompt": forced["prompt_token_ids"], **params,
            "vllm_xargs": forced["params"]["extra_args"], "return_token_ids": True}
    reply = served(body)
    choice = reply["choices"][0]
    assert choice["token_ids"] == plugged["forced"]["token_ids"]
    assert choice["text"] == plugged["forced"]["text"]
