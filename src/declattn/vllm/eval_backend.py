"""``declattn eval --backend vllm``: the harness's arms through vLLM, in the same rows.

Every response a spec still lacks is sent to one in-process vLLM engine in one batch,
with prefix caching on, so the DA arms of a sample (one prompt) share its prefill and a
GPU user gets the paper's kind of table from one command. What vLLM returns is a token
sequence and, for DA requests, the plugin's read log; the row is then built by the
engine backend's own ``eval.rows.build_row``, from:

- the arm's session (the same ``DASession`` / ``PlainSession`` our engine would run,
  built for vLLM's block size), fed vLLM's tokens one by one: its steps, accounting,
  declarations and answer are counted exactly as our engine counts its own response
  (the one ``Accounting`` that replay and the live engine share);
- a record of the request (``engine.request.Request``, the data class our engine keeps
  per sequence) holding vLLM's tokens, finish reason, timings, and per decode step the
  block ids the plugin handed vLLM's kernel (``blocks_read``), so a row says what was
  really read, not what the scope allowed.

Rows gain ``backend: "vllm"`` and ``vllm``: the plugin's per-request report (whether
reads were really restricted, and if not, why).

``streaming`` (StreamingLLM on the ordinary prompt) is a block table too: its requests
name a budget of blocks per step (``xargs.StreamingSpec``), taken from the budget arm's
row of the same sample (``ArmSettings.budget_arm``, ``da`` by default) as the engine
backend takes it. Those rows exist only once that arm has run, so the sparse arms go in
a second batch, after the rows of the first are written. ``quest`` is refused: it picks
each step's blocks from that step's query-key scores inside attention, which a block
table cannot express. vLLM has no runaway guard, so DA sessions here run without one (a
response runs to ``</answer>``, end of sequence or max tokens).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from declattn.vllm.offline import DEFAULT_BLOCK_SIZE, worker_logs

ARMS = ("vanilla", "vanilla-chunks", "da-nm", "da", "da-constrained", "da-find",
        "da-find-constrained", "da-find-index", "da-economy", "streaming")
REFUSED = {
    "quest": "Quest picks each step's blocks from query-key scores inside attention, which "
             "a block table cannot express",
    "da-model": "a model trained to declare runs in our engine (--backend engine), which "
                "applies its declattn.json; export it (declattn export) to serve it elsewhere",
    "da-model-wrong": "the forced-wrong-chunk control rewrites the focus in our engine's "
                      "session; the plugin reads what the model declares",
}
SECOND = ("streaming",)
"""Arms whose budget comes from another arm's row: run in the batch after it."""
DEFAULT_SETTINGS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "async_scheduling": False,
    "block_size": DEFAULT_BLOCK_SIZE,
    "max_num_seqs": 16,
    "disable_log_stats": False,  # per-request timestamps
}
"""What the eval runs vLLM with unless told otherwise (``--vllm-arg``). On a GPU add
``compilation_config={"cudagraph_mode": "PIECEWISE"}`` (or ``enforce_eager=True``): under
vLLM's default full CUDA graphs the plugin cannot skip, and every row says so."""


class UnsupportedArm(ValueError):
    """An arm the vLLM backend cannot run."""


def check_arms(arms: list[str]) -> None:
    bad = [a for a in arms if a not in ARMS]
    if bad:
        why = "; ".join(f"{a}: {REFUSED.get(a, 'unknown arm')}" for a in bad)
        raise UnsupportedArm(f"--backend vllm runs {', '.join(ARMS)}; not {why}")


@dataclass
class _Pending:
    """One response to run: its key, sample, arm and the session that counts it."""

    key: str
    index: int
    arm: str
    sample: Any
    session: Any
    prompt: dict[str, Any]
    params: Any
    budget: int | None = None  # a sparse arm's blocks per step
    budget_mean: float | None = None  # the budget arm's mean blocks per step


def run_eval_vllm(
    spec: Any,
    out: Path,
    *,
    machine: dict[str, Any],
    settings: dict[str, Any] | None = None,
    on_status: Callable[[str], None] | None = None,
    llm: Any = None,
    served: Any = None,
) -> list[dict[str, Any]]:
    """Run what ``out`` lacks of ``spec`` through vLLM and return all of its rows, in
    the engine backend's order (lengths, tasks, samples, arms).

    ``llm``: an in-process ``vllm.LLM`` with the plugin to use instead of starting one
    with ``settings`` (its block size must be ``settings["block_size"]``); ``served``:
    the ``offline.ServedModel`` of ``spec.model`` when the caller has it (else it is
    loaded)."""
    from declattn.eval.rows import row_key
    from declattn.eval.runner import read_rows
    from declattn.eval.tasks import generate
    from declattn.vllm.offline import offline_env

    check_arms(list(spec.arms))
    status = on_status or (lambda _text: None)
    offline_env()
    llm_settings = {**DEFAULT_SETTINGS, **(settings or {})}
    block_size = int(llm_settings["block_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in read_rows(out)}
    order: list[str] = []
    units: list[tuple[int, Any, dict[str, str]]] = []  # index, sample, arm -> missing key
    run = _Run(spec, block_size, machine, served)
    for task, length, index in spec.units():
        keys = {a: row_key(spec.model, task, length, index, a) for a in spec.arms}
        order += keys.values()
        if all(k in done for k in keys.values()):
            continue
        if run.data is None:
            status("loading the tokenizer")
            run.load()
        assert run.data is not None
        sample = generate(task, run.data, length, spec.seed + index)
        for key in keys.values():
            if key in done:
                _same_sample(done[key], sample)
        units.append((index, sample, {a: k for a, k in keys.items() if k not in done}))
    for wave in (False, True):
        pending, rows = [], []
        for index, sample, missing in units:
            for arm, key in missing.items():
                if (arm in SECOND) != wave:
                    continue
                got = run.prepare(key, index, arm, sample, done)
                (pending if isinstance(got, _Pending) else rows).append(got)
        if pending:
            if llm is None:  # long enough for this batch's prompts and the next one's
                later = [] if wave else [run.plain_len(sample) for _, sample, missing in units
                                         if any(a in SECOND for a in missing)]
                longest = max([len(p.prompt["prompt_token_ids"]) for p in pending] + later)
                llm = run.start_llm(longest, llm_settings, status)
            rows += _run_batch(spec, pending, run.served, run.settings or llm_settings,
                               machine, status, llm)
        with out.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                done[row["key"]] = row
    return [done[k] for k in order]


class _Run:
    """What one eval run shares across its requests: the served model, its task data and
    positions, and the constraint tables of the front-end sessions (built once)."""

    def __init__(self, spec: Any, block_size: int, machine: dict[str, Any],
                 served: Any = None) -> None:
        from declattn.da.constrain import VocabCache
        from declattn.da.constrain_find import FindVocab
        from declattn.da.constrain_open import OpeningVocab

        self.spec = spec
        self.block_size = block_size
        self.machine = machine
        self.served: Any = served
        self.data: Any = None
        self.positions = 0
        self.settings: dict[str, Any] | None = None  # what vLLM was started with, if here
        self.vocabs = VocabCache()
        self.find_vocabs = VocabCache(FindVocab.from_tokenizer)
        self.opening_vocabs = VocabCache(OpeningVocab.from_tokenizer)

    def load(self) -> None:
        from declattn.eval.tasks import TaskData
        from declattn.vllm.offline import served_model

        if self.served is None:
            self.served = served_model(self.spec.model)
        self.data = TaskData.for_tokenizer(self.served.tokenizer)
        self.positions = _positions(self.served.directory)

    def prepare(self, key: str, index: int, arm: str, sample: Any,
                done: dict[str, dict[str, Any]]) -> _Pending | dict[str, Any]:
        """The request of one row, or the row itself where it cannot run."""
        from declattn.eval.arms import budget_from_da
        from declattn.eval.rows import error_row, row_key

        spec, s = self.spec, self.spec.settings
        budget = None
        if arm in SECOND:
            source = s.budget_arm
            da = done.get(row_key(spec.model, sample.task, sample.length, index, source))
            if da is None or "error" in da:
                why = f"the {source} arm failed" if da else f"no {source} row"
                return error_row(spec.model, sample, index, arm, f"no budget: {why}",
                                 self.machine)
            budget = budget_from_da(da, s.sink)
        p = _prepare(key, index, arm, sample, self.served.tokenizer, s, self.block_size,
                     budget, self)
        n = len(p.prompt["prompt_token_ids"])
        if n + s.max_tokens > self.positions:
            why = (f"prompt of {n} tokens + max_tokens {s.max_tokens} exceeds the model's "
                   f"{self.positions} positions")
            return error_row(spec.model, sample, index, arm, why, self.machine)
        return p

    def plain_len(self, sample: Any) -> int:
        """Tokens of the sample's ordinary prompt (the sparse arms')."""
        from declattn.protocol.prompt import render_plain

        return len(render_plain(self.served.tokenizer, sample.context,
                                sample.prompt_question(False)))

    def start_llm(self, longest: int, settings: dict[str, Any],
                  status: Callable[[str], None]) -> Any:
        import vllm

        from declattn.vllm.offline import make_llm

        self.settings = {"max_model_len": longest + self.spec.settings.max_tokens + 64,
                         **settings}
        status(f"starting vLLM {vllm.__version__}")
        return make_llm(self.served.directory, **self.settings)


def _positions(directory: Path) -> int:
    config = json.loads((directory / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config["text_config"][
        "max_position_embeddings"])


def _same_sample(row: dict[str, Any], sample: Any) -> None:
    if row["header"]["context_sha256"] != sample.context_sha256:
        raise RuntimeError(f"{row['key']}: the regenerated context differs from the one in "
                           "the results file; use a new output directory")


def _prepare(key: str, index: int, arm: str, sample: Any, tok: Any, settings: Any,
             block_size: int, budget: tuple[int, float] | None, run: _Run) -> _Pending:
    from vllm import SamplingParams

    from declattn.api.session import DASession, PlainSession
    from declattn.eval.arms import DA_ARMS
    from declattn.eval.baselines import StreamingSession
    from declattn.protocol.prompt import render_plain
    from declattn.protocol.segment import segment, token_counter
    from declattn.vllm.request import session_request
    from declattn.vllm.xargs import StreamingSpec

    question = sample.prompt_question(arm in DA_ARMS)
    if arm in DA_ARMS:
        options = dataclasses.replace(settings.da_options(arm), runaway=False)
        ids_on = options.constrain and options.focus != "find"
        find_on = options.constrain and options.focus != "ids"
        sess = DASession(tok, sample.context, question, options, block_size,
                         max_tokens=settings.max_tokens,
                         focus_vocab=run.vocabs.get(tok) if ids_on else None,
                         find_vocab=run.find_vocabs.get(tok) if find_on else None,
                         opening_vocab=run.opening_vocabs.get(tok)
                         if options.needs_tag_vocab else None)
        req = session_request(sess, label=key)
        params = req.sampling_params(max_tokens=settings.max_tokens)
        return _Pending(key, index, arm, sample, sess, req.prompt(), params)
    if arm == "streaming":
        assert budget is not None
        blocks, mean = budget
        ids = render_plain(tok, sample.context, question)
        sess = StreamingSession(ids, block_size, blocks, settings.sink)
        extra = StreamingSpec(len(ids), blocks, settings.sink, label=key).to_args()
        params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens,
                                extra_args=extra)
        return _Pending(key, index, arm, sample, sess, {"prompt_token_ids": ids}, params,
                        budget=blocks, budget_mean=mean)
    if arm == "vanilla-chunks":  # the plain final turn over the DA arms' chunk transcript
        o = settings.da_options("da")
        chunks = segment(sample.context, token_counter(tok), o.target, o.cap)
        sess = PlainSession.over_chunks(tok, chunks, question, block_size, o)
    else:
        sess = PlainSession.for_question(tok, sample.context, question, block_size)
    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
    return _Pending(key, index, arm, sample, sess, {"prompt_token_ids": sess.prompt_ids}, params)


def _run_batch(spec: Any, pending: list[_Pending], served: Any, settings: dict[str, Any],
               machine: dict[str, Any], status: Callable[[str], None],
               llm: Any) -> list[dict[str, Any]]:
    import vllm

    from declattn.eval.rows import build_row, sample_chunks

    kv_dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    status(f"vLLM: {len(pending)} responses in one batch")
    t0 = time.perf_counter()
    outs = llm.generate([p.prompt for p in pending], [p.params for p in pending],
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    labels = [p.key for p in pending if p.params.extra_args]
    logs = llm.collective_rpc(worker_logs, args=(labels,))[0] if labels else {}
    machine = {**machine, "backend": f"vllm {vllm.__version__}",
               "vllm_batch_seconds": round(wall, 3), "vllm_settings": _plain(settings)}
    rows = []
    s = spec.settings
    for p, o in zip(pending, outs, strict=True):
        log = logs.get(p.key)
        run = _arm_run(p, o, served.tokenizer, log, kv_dtype)
        chunks = sample_chunks(run, p.sample, served.tokenizer, s.chunk_target, s.chunk_cap)
        row = build_row(run, p.sample, model=spec.model, index=p.index, chunks=chunks,
                        machine=machine)
        row["backend"] = "vllm"
        row["vllm"] = None if log is None else log["report"]
        if p.budget_mean is not None:
            row["budget_da_mean_blocks"] = p.budget_mean
        rows.append(row)
    return rows


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(settings, default=str))


def _arm_run(p: _Pending, output: Any, tok: Any, log: dict[str, Any] | None,
             kv_dtype: str) -> Any:
    """The vLLM response as the engine backend's ``ArmRun``: the session fed vLLM's
    tokens step by step (our engine's one-step lag: the step producing token ``k`` is
    counted at ``prompt_len + k`` positions), and a request record of what happened."""
    from declattn.engine.detok import Detokenizer
    from declattn.engine.request import Request
    from declattn.engine.sampler import SamplingParams
    from declattn.eval.arms import ArmRun

    o = output.outputs[0]
    ids = [int(t) for t in o.token_ids]
    sess = p.session
    detok = Detokenizer(tok)
    n_prompt = len(sess.prompt_ids)
    texts: list[str] = []
    reason = None
    for k, token in enumerate(ids):
        if k >= 1:
            sess.view(n_prompt + k)
        text = detok.add(token)
        if k == len(ids) - 1 and o.finish_reason == "stop" and o.stop_reason is None:
            text += detok.flush()  # ended by end of sequence, as our engine flushes there
        texts.append(text)
        reason = sess.on_token(token, text) or reason
    record = Request(
        seq_id=0,
        params=SamplingParams(max_tokens=int(p.params.max_tokens)),
        controller=sess,
        detok=detok,
        generator=None,
        output_ids=ids,
        token_texts=texts,
        reads=_step_reads(log),
        finish_reason=reason or _finish(o),
        cached_tokens=int(output.num_cached_tokens or 0),
    )
    wall = _timing(output, record)
    return ArmRun(p.arm, sess, record, wall, p.budget, kv_dtype)


def _finish(o: Any) -> str:
    if o.finish_reason == "stop":
        return "eos" if o.stop_reason is None else "stop"
    return str(o.finish_reason)


def _timing(output: Any, record: Any) -> float:
    """Per-request seconds from vLLM's engine-core timestamps (latencies inside a batch,
    not a request's cost alone); the wall time from queueing to the last token."""
    m = output.metrics
    if m is None or not m.first_token_ts:
        return 0.0
    record.prefill_seconds = max(0.0, m.first_token_ts - m.scheduled_ts)
    record.decode_seconds = max(0.0, m.last_token_ts - m.first_token_ts)
    return max(0.0, m.last_token_ts - m.queued_ts)


def _step_reads(log: dict[str, Any] | None) -> list[Any]:
    """Per decode step, what the plugin handed vLLM's kernel (DA rows with masking);
    none for requests the plugin leaves alone (their tables are untouched: every block)."""
    from declattn.engine.request import StepRead

    if log is None:
        return []
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in log["reads"]:
        by_step.setdefault(r["step"], []).append(r)
    out = []
    for step, rs in sorted(by_step.items()):
        out.append(StepRead(
            index=step,
            length=rs[0]["length"],
            blocks=tuple(rs[0]["physical"]),
            layers_agree=all(r["logical"] == rs[0]["logical"] for r in rs),
            global_bytes=sum(r["bytes"] for r in rs),
            sliding_bytes=None if log["bounded"] else 0,  # groups left alone: not logged
            seconds=None,
        ))
    return out
