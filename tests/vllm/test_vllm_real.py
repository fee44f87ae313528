"""DA on a real vLLM (a CPU build of vLLM 0.32), against our own engine.

One vLLM engine runs in this process with the plugin; a second, in a child process with
the plugin switched off (``VLLM_PLUGINS=""``), runs the same batch as the reference for
"untouched"; a third is vLLM's OpenAI-compatible server. All use fp32 and block size 32,
as does our engine here, so greedy outputs can be compared token for token; the first two
cache prefixes, so the batch's requests over one prompt share its prefill (as they do
in ``eval --backend vllm``).

Skipped where vLLM is not installed (the main virtual environment); ``make test`` runs
this module in the vLLM one (.venv-vllm).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from phrases import naming_phrase

pytest.importorskip("vllm.v1.sample.logits_processor")  # a real vLLM, not this folder

from declattn.vllm.offline import offline_env  # noqa: E402

offline_env()


from declattn.api import Engine  # noqa: E402
from declattn.da.options import DAOptions  # noqa: E402
from declattn.da.replay import replay  # noqa: E402
from declattn.da.scope import Scope  # noqa: E402
from declattn.engine.controller import Forced  # noqa: E402
from declattn.engine.sampler import SamplingParams as EngineParams  # noqa: E402
from declattn.protocol.modes import Mode  # noqa: E402
from declattn.protocol.prompt import render_plain  # noqa: E402
from declattn.vllm import build_request, link  # noqa: E402
from declattn.vllm.compact import compacted_length  # noqa: E402
from declattn.vllm.offline import make_llm, output_record  # noqa: E402
from declattn.vllm.xargs import StreamingSpec  # noqa: E402

BLOCK = 32
MAX_TOKENS = 32
OPTIONS = DAOptions(target=128, cap=192, constrain=True, runaway=False, min_context=0)
FIND_CHUNK = 3
STREAM_BUDGET = 6  # blocks per step for the StreamingLLM request (its prompt has 15)
QUESTION = "What is the essay about?"
OTHER_QUESTION = "Who is the keeper of the lighthouse?"
FORCED_PREFIX = '<focus magic_chunks="3">\nThe'
ESSAY = Path(__file__).resolve().parents[2] / "src" / "declattn" / "data" / "sample_essay.txt"


def _engine_run(engine: Engine, context: str, force: list[int]) -> tuple[list[int], Any, Any]:
    """Our engine's DA run, teacher-forced the way the plugin forces (forced tokens win
    over the focus constraint)."""
    sess = engine.session(context, QUESTION, options=OPTIONS, max_tokens=MAX_TOKENS)
    req = engine.add(Forced(sess, force), EngineParams(max_tokens=MAX_TOKENS))
    for _ in engine.run(req):
        pass
    return list(req.output_ids), sess, req


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("smollm2-135m", dtype="fp32", block_size=BLOCK)


@pytest.fixture(scope="module")
def context() -> str:
    return ESSAY.read_text(encoding="utf-8")[:2000]


@pytest.fixture(scope="module")
def batch(engine: Engine, context: str) -> dict[str, dict[str, Any]]:
    """The mixed batch, by name: three DA requests (teacher-forced into a focus by id,
    teacher-forced into a find focus, free), a StreamingLLM one over the vanilla prompt,
    and two plain ones (the vanilla prompt, and the DA prompt without DA args)."""
    tok = engine.tokenizer
    force = tok.encode(FORCED_PREFIX, add_special_tokens=False)
    forced = build_request(context, QUESTION, tok, OPTIONS, force=force, label="forced")
    free = build_request(context, QUESTION, tok, OPTIONS, label="free")
    # the find request reads the same prompt (the reader takes either focus form), so the
    # prefix cache gives it that prompt's prefill
    phrase = naming_phrase([c.text for c in forced.chunks], FIND_CHUNK)
    find_force = tok.encode(f'<focus find="{phrase}">\nThe', add_special_tokens=False)
    find = build_request(context, QUESTION, tok, OPTIONS, force=find_force, label="find")
    plain = render_plain(tok, context, OTHER_QUESTION)
    stream = StreamingSpec(len(plain), STREAM_BUDGET, OPTIONS.sink, label="stream")
    # Every request runs exactly MAX_TOKENS steps, with or without the plugin, so both
    # runs see the same batch shapes at every step (a batch of another shape may round
    # a float differently, which is not what "untouched" is about).
    base = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, "ignore_eos": True}
    return {
        "forced": {"prompt_token_ids": forced.prompt_token_ids,
                   "params": {**base, "extra_args": forced.extra_args}, "force": force},
        "plain": {"prompt_token_ids": plain, "params": dict(base)},
        "stream": {"prompt_token_ids": plain,
                   "params": {**base, "extra_args": stream.to_args()}},
        "free": {"prompt_token_ids": free.prompt_token_ids,
                 "params": {**base, "extra_args": free.extra_args}},
        "free_as_plain": {"prompt_token_ids": free.prompt_token_ids, "params": dict(base)},
        "find": {"prompt_token_ids": find.prompt_token_ids,
                 "params": {**base, "extra_args": find.extra_args}, "force": find_force,
                 "phrase": phrase},
    }


@pytest.fixture(scope="module")
def unplugged(engine: Engine, batch: dict, tmp_path_factory: pytest.TempPathFactory):
    """The same batch in a child process with the plugin off; started early, read late."""
    tmp = tmp_path_factory.mktemp("unplugged")
    spec = {
        "model": str(engine.loaded.weights_dir),
        "llm": {"block_size": BLOCK, "enable_prefix_caching": True},
        "requests": [{k: r[k] for k in ("prompt_token_ids", "params")} for r in batch.values()],
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "declattn.vllm.offline", str(tmp / "spec.json"),
         str(tmp / "out.json")],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "log.txt", "w"),  # noqa: SIM115
        start_new_session=True,
    )

    def result() -> dict[str, dict[str, Any]]:
        rc = proc.wait(timeout=600)
        assert rc == 0, (tmp / "log.txt").read_text()[-3000:]
        outs = json.loads((tmp / "out.json").read_text())
        return dict(zip(batch, outs, strict=True))

    yield result
    _stop_group(proc)


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
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
    _stop_group(proc)
    log.close()


def _stop_group(proc: subprocess.Popen) -> None:
    """End ``proc`` and every process it started (vLLM's server runs its engine core and
    worker as processes of their own, which outlive a server killed alone)."""
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the server is gone: its group may still hold children
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        return


def _tail(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


@pytest.fixture(scope="module")
def llm(engine: Engine, unplugged, served) -> Any:
    """The in-process vLLM engine with the plugin (started after the child processes)."""
    return make_llm(engine.loaded.weights_dir, block_size=BLOCK, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def plugged(batch: dict, llm: Any) -> dict[str, Any]:
    """The batch through vLLM with the plugin, in one ``generate`` call."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch.values()]
    params = [SamplingParams(**r["params"]) for r in batch.values()]
    outs = llm.generate(prompts, params, use_tqdm=False)
    (processor,) = [p for p in link.processors() if p.enabled]
    result: dict[str, Any] = dict(zip(batch, map(output_record, outs), strict=True))
    tracked = ("forced", "free", "find", "stream")
    result["reads"] = {name: processor.reads(name) for name in tracked}
    result["reports"] = {name: processor.report(name) for name in tracked}
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
    report = plugged["reports"]["forced"]  # the per-request field: reads really restricted
    assert report.reads_restricted is True and report.blockers == ()
    assert report.restricted_steps == report.decode_steps == len(plugged["forced"]["token_ids"]) - 1


def test_free_da_output_equals_our_engine(engine, context, plugged) -> None:
    # (right after the forced run: our engine's prefix cache still holds the prompt)
    ids, _, _ = _engine_run(engine, context, [])
    assert len(ids) > 8
    assert plugged["free"]["token_ids"][: len(ids)] == ids


def test_teacher_forced_find_focus_reads_the_chunk_its_phrase_names(engine, context, batch,
                                                                    plugged) -> None:
    """``<focus find="...">`` through vLLM: the engine core rebuilt the chunk texts from
    the prompt's chunk spans, resolved the phrase to the chunk our engine resolves it to,
    and from the step after the tag on, every step read that chunk's blocks only (the
    scaffold, the question and the response aside); the output equals our engine's token
    for token. (The prompt is the ids one, whose prefill the batch shares: the reader
    takes either focus form; the find instruction's prompt is the eval test's.)"""
    entry = batch["find"]
    ids, sess, _ = _engine_run(engine, context, entry["force"])
    focus = next(d for d in sess.declarations if d.kind == "focus")  # the forced one
    assert (focus.phrase, focus.focus_ids, focus.match) == (entry["phrase"], (FIND_CHUNK,),
                                                            "exact")
    assert plugged["find"]["token_ids"][: len(ids)] == ids
    assert len(ids) > len(entry["force"]) + 8
    layout = build_request_layout(entry)
    reads = plugged["reads"]["find"]
    assert [r.step for r in reads] == list(range(1, len(plugged["find"]["token_ids"])))
    # from the step after the tag closes, until the model changes mode (its own next tag)
    tag = engine.tokenizer.encode(f'<focus find="{entry["phrase"]}">', add_special_tokens=False)
    assert {r.mode for r in reads[: len(tag) - 1]} == {Mode.GLOBAL}
    focused = []
    for r in reads[len(tag) - 1 :]:
        if (r.mode, r.focus_ids) != (Mode.FOCUS, (FIND_CHUNK,)):
            break
        focused.append(r)
    assert focused[0].step == len(tag) and len(focused) >= 8
    for r in focused:
        want = tuple(Scope(layout, Mode.FOCUS, (FIND_CHUNK,)).kept_blocks(r.length, BLOCK))
        assert r.focus_ids == (FIND_CHUNK,) and r.kept == r.logical == want
        assert len(r.physical) == len(want) < -(-r.length // BLOCK)
    views = list(sess.expected_views)
    assert [r.logical for r in reads[: len(views)]] == views
    assert plugged["reports"]["find"].reads_restricted is True


def test_streaming_request_reads_its_budget_and_equals_our_engines_streaming_arm(
        engine, batch, plugged) -> None:
    """The StreamingLLM baseline as a block table: every decode step was handed exactly
    the sink's block and the most recent ones, ``STREAM_BUDGET`` in all, and the greedy
    output is our engine's ``StreamingSession`` output at that budget."""
    from declattn.eval.baselines import StreamingSession, streaming_view

    ids = batch["stream"]["prompt_token_ids"]
    sess = StreamingSession(ids, BLOCK, STREAM_BUDGET, OPTIONS.sink)
    req = engine.add(sess, EngineParams(max_tokens=MAX_TOKENS))
    for _ in engine.run(req):
        pass
    out = plugged["stream"]["token_ids"]
    assert out[: len(req.output_ids)] == list(req.output_ids) and len(req.output_ids) > 8
    # the same prompt read in full: the same greedy words, maybe, never the same logprobs
    assert plugged["stream"]["logprobs"] != plugged["plain"]["logprobs"]
    reads = plugged["reads"]["stream"]
    assert [r.step for r in reads] == list(range(1, len(out)))
    for r in reads:
        want = tuple(streaming_view(-(-r.length // BLOCK), STREAM_BUDGET, 1))
        assert r.mode == "streaming" and r.kept == r.logical == want
        assert len(set(r.physical)) == len(r.physical) == STREAM_BUDGET
        assert r.seq_len == compacted_length(r.length, STREAM_BUDGET, BLOCK)
    assert [r.logical for r in reads[: len(sess.expected_views)]] == sess.expected_views
    assert plugged["reports"]["stream"].reads_restricted is True


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


STEP_COUNTS = ("mode", "focus_ids", "length", "logical", "physical", "vanilla_logical",
               "vanilla_physical")
MEASURED = ("blocks_read", "global_bytes")  # what the kernel was handed: masked rows only
MASKED = ("da-find", "streaming")


def test_eval_backend_rows_match_the_engine_backends_accounting(engine, llm, tmp_path) -> None:
    """``declattn eval --backend vllm`` against the engine backend on one small sample, at
    the same block size (nothing to round): the same rows, and where the transcripts
    agree (both greedy, fp32) the same steps and totals; at every step of the DA arm and
    of StreamingLLM, the blocks and KV bytes handed to vLLM's kernel are those our
    engine's attention read, and StreamingLLM's are its budget, taken from the DA row.
    The DA arm is ``da-find`` (the budget arm here): the same path as ``da`` but for the
    focus form, whose ids arm the forced and free tests above hold. (Our engine may stop
    a DA response earlier: its runaway guard, which vLLM lacks.) ``da-economy`` (scaffold
    steps read as local) and ``vanilla-chunks`` (the plain turn over the chunk transcript)
    ride along: the same prompts and step counts; they may answer in fewer steps."""
    from declattn.eval.arms import ArmSettings
    from declattn.eval.rows import steps_of
    from declattn.eval.runner import EvalSpec, run_eval
    from declattn.vllm.eval_backend import run_eval_vllm
    from declattn.vllm.offline import ServedModel

    spec = EvalSpec(model="smollm2-135m", tasks=["vt"], lengths=[400],
                    arms=["da-find", "da-economy", "vanilla-chunks", "vanilla", "streaming"],
                    samples=1,
                    settings=ArmSettings(max_tokens=16, chunk_target=160, chunk_cap=224,
                                         budget_arm="da-find"))
    ours = run_eval(engine, spec, tmp_path / "engine.jsonl", machine={})
    served = ServedModel(engine.loaded.weights_dir, engine.tokenizer)
    theirs = run_eval_vllm(spec, tmp_path / "vllm.jsonl", machine={}, llm=llm,
                           settings={"block_size": BLOCK}, served=served)
    assert [r["key"] for r in theirs] == [r["key"] for r in ours]
    for a, b in zip(ours, theirs, strict=True):
        assert "error" not in a and "error" not in b
        for field in ("prompt_tokens", "block_size", "chunks", "evidence_chunks", "header"):
            assert a[field] == b[field], field
        sa, sb = steps_of(a), steps_of(b)
        n = min(len(sa), len(sb))
        assert n >= (8 if a["arm"] in ("da-find", "vanilla", "streaming") else 1)
        same_text = a["output"]["text"] == b["output"]["text"]
        common = [*STEP_COUNTS, *(MEASURED if b["arm"] in MASKED else ())]
        for x, y in zip(sa[:n], sb[:n], strict=True):
            assert {k: x[k] for k in common} == {k: y[k] for k in common}
        if same_text:
            assert a["totals"] == b["totals"] and a["by_mode"] == b["by_mode"]
        assert b["backend"] == "vllm"
    rows = {r["arm"]: r for r in theirs}
    for arm in MASKED:
        assert rows[arm]["vllm"]["reads_restricted"] is True, arm
        assert all(st["blocks_read"] == st["physical"] // BLOCK for st in steps_of(rows[arm]))
    # StreamingLLM at the DA row's budget, as the engine backend takes it. A DA row that
    # stayed global (SmolLM2's, here) gives a budget that covers the shorter plain prompt:
    # then every block is read (a budget below the sequence: the streaming test above).
    stream, engine_stream = rows["streaming"], next(r for r in ours if r["arm"] == "streaming")
    budget = stream["budget_blocks"]
    assert budget == engine_stream["budget_blocks"]
    assert stream["budget_da_mean_blocks"] == engine_stream["budget_da_mean_blocks"]
    assert all(st["blocks_read"] == min(budget, -(-st["length"] // BLOCK))
               for st in steps_of(stream))


def test_doctor_reports_the_cpu_build_as_it_is(llm, plugged) -> None:
    """What ``declattn doctor`` prints, asked of this engine's worker: runner V1, the CPU
    backend, no blocker, and the forced request's steps really restricted."""
    from declattn.vllm.doctor import DoctorReport, GroupLine, WorkerReport, inspect_worker

    (info,) = llm.collective_rpc(inspect_worker, args=("forced",))
    worker = WorkerReport(groups=[GroupLine(**g) for g in info.pop("groups")], **info)
    assert worker.runner == "v1" and worker.processor and worker.blockers == []
    (group,) = worker.groups
    assert (group.backend, group.ok, group.block_size) == ("CPU_ATTN", True, BLOCK)
    assert 0 < group.probe_blocks_read < group.probe_blocks_full
    assert worker.probe is not None and worker.probe["reads_restricted"] is True
    assert DoctorReport("0.32.0", "smol", {}, [worker]).active
