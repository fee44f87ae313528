"""The prepared GPU check: what only a GPU can show, in one run of under 10 minutes.

Run it as ``scripts/gpu_check.sh`` (this file, from a checkout, with ``src`` on the path).
Every check prints PASS, FAIL or SKIP with its figures or its reason, then a summary; the
exit status is 1 if any check failed (with ``--strict``, also if any was skipped).

Checks:

1. engine, CUDA: paged attention == the dense reference (greedy ids, random-weight
   Llama, fp32);
2. engine, CUDA: the read counter == the scope (every DA step's blocks, every layer), on
   ``da-tiny`` answering from its own declarations;
3. engine, CUDA: decode step time at a 32K-token prompt, the DA scope of a 16-chunk
   layout focused on 2 chunks against every block, on a KV-heavy random-weight model
   (bf16, synthetic prompt K/V), the two arms alternating in one process;
4. ``compact_rows`` against a gather + SDPA reference, on every device present (the
   CPU part runs anywhere);
5. vLLM with the plugin, CUDA, each engine in its own process: the read log is
   non-empty and below the full reads; a ``<focus find="...">`` reads the chunks its
   phrase resolves to; a StreamingLLM request reads its budget at every step; a DA
   request that stays global gives plain vLLM's token ids; eager and piecewise CUDA
   graphs agree; under vLLM's default full CUDA graphs DA reports ``reads_restricted``
   false and names the fix.

Models: checks 1-3 need no download (random weights, and ``da-tiny``, shipped in the
repository); check 5 needs vLLM 0.32 and ``--model`` (default ``smollm2-135m``: a Hugging
Face directory, or a name our loader resolves). ``--device cpu`` runs checks 1-3 and 5
on the CPU: a dry run of their logic, not a GPU result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKS: list[tuple[str, Callable[[argparse.Namespace], str]]] = []


class Skip(Exception):
    """The check cannot run here; the message says why."""


def check(title: str) -> Callable:
    def register(fn: Callable[[argparse.Namespace], str]) -> Callable:
        CHECKS.append((title, fn))
        return fn

    return register


def _device(args: argparse.Namespace) -> torch.device:
    """CUDA, or the CPU when asked (``--device cpu``: a dry run of the checks' logic)."""
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def _tokenizer() -> Any:
    from declattn.engine.tokenizer import load_tokenizer

    return load_tokenizer("da-tiny")


def _llama(vocab: int, positions: int, dtype: torch.dtype, device: torch.device) -> Any:
    from declattn.bench.e2e import random_model
    from declattn.engine.models import ModelConfig

    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "max_position_embeddings": positions, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    })
    return random_model(config, dtype).to(device)


# -- 1-3: our engine's CUDA path -------------------------------------------------------
@check("engine (CUDA): paged attention == dense reference, greedy ids")
def engine_paged_vs_dense(args: argparse.Namespace) -> str:
    dev = _device(args)
    from declattn.bench.e2e import engine_over
    from declattn.engine.controller import Controller
    from declattn.engine.dense import DenseAttention
    from declattn.engine.sampler import SamplingParams

    tok = _tokenizer()
    model = _llama(len(tok), 4096, torch.float32, dev)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, len(tok), (700,), generator=g).tolist()
    n = 32
    engine = engine_over(model, tok)
    req = engine.add(Controller(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in engine.run(req):
        pass
    attn = DenseAttention()
    dense: list[int] = []
    with torch.inference_mode():
        h = model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), attn)
        dense.append(int(model.logits(h[-1:])[0].argmax()))
        while len(dense) < n:
            pos = torch.tensor([len(prompt) + len(dense) - 1], device=dev)
            h = model(torch.tensor(dense[-1:], device=dev), pos, attn)
            dense.append(int(model.logits(h)[0].argmax()))
    paged = list(req.output_ids)
    agree = next((i for i, (a, b) in enumerate(zip(paged, dense, strict=True)) if a != b), n)
    if agree < n:
        raise AssertionError(f"paged and dense part at token {agree}: {paged} vs {dense}")
    return f"{n} greedy tokens identical over a {len(prompt)}-token prompt"


@check("engine (CUDA): blocks read == the scope's kept blocks, every step and layer")
def engine_reads_vs_scope(args: argparse.Namespace) -> str:
    """On ``da-tiny`` (shipped in the repository), answering from its own declarations."""
    dev = _device(args)
    import random

    from declattn.api import Engine
    from declattn.engine.sampler import SamplingParams
    from declattn.train.evaluate import EVAL_SEED_BASE
    from declattn.train.tasks import make_episode

    engine = Engine.from_pretrained("da-tiny", dtype="fp32", device=dev)
    ep = make_episode(random.Random(EVAL_SEED_BASE + 9), 16, False)
    sess = engine.session(ep.context, ep.question, da=True, max_tokens=64)
    req = engine.add(sess, SamplingParams(max_tokens=64))
    for _ in engine.run(req):
        pass
    reads = [r.blocks for r in req.reads]
    if not reads or reads != list(sess.expected_views):
        raise AssertionError("the blocks read differ from the scope's kept blocks")
    if not all(r.layers_agree for r in req.reads):
        raise AssertionError("the layers of a step read different blocks")
    full = sum(-(-r.length // engine.block_size) for r in req.reads)
    read = sum(len(b) for b in reads)
    if read >= full:
        raise AssertionError(f"nothing skipped: {read} of {full} blocks")
    return (f"da-tiny: {len(reads)} steps, {read:,} of {full:,} blocks read, all layers "
            f"agree; answer {sess.answer!r} (expected {ep.answer!r})")


@check("engine (CUDA): DA vs full reads, decode step time at a 32K-token prompt")
def engine_step_time_32k(args: argparse.Namespace) -> str:
    """A KV-heavy random-weight model (bf16), its prompt's K/V synthetic: one arm reads
    the DA scope of a 16-chunk layout focused on 2 chunks, the other every block; the
    arms alternate step by step in this process."""
    dev = _device(args)
    from declattn.bench.e2e import engine_over, kv_heavy_config, random_model
    from declattn.da.scope import Scope
    from declattn.engine.controller import Controller
    from declattn.engine.sampler import SamplingParams
    from declattn.protocol.layout import Layout, Span
    from declattn.protocol.modes import Mode

    class Viewing(Controller):
        def __init__(self, ids: list[int], scope: Scope | None, block: int) -> None:
            super().__init__(ids)
            self.scope, self.block = scope, block

        def view(self, length: int) -> Any:
            return None if self.scope is None else self.scope.kept_blocks(length, self.block)

    tok = _tokenizer()
    prompt_len, chunk, steps, bs = 32_768, 2_000, 64, 16
    layout = Layout(prompt_len, Span(0, 16),
                    tuple(Span(64 + i * chunk, 64 + (i + 1) * chunk) for i in range(16)),
                    Span(prompt_len - 64, prompt_len))
    scope = Scope(layout, Mode.FOCUS, (7, 8))
    model = random_model(kv_heavy_config(len(tok), 40_000), torch.bfloat16).to(dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (prompt_len,), generator=g).tolist()
    arms = []
    for sc in (scope, None):
        engine = engine_over(model, tok).with_pool(-(-(prompt_len + steps + bs) // bs))
        req = engine.add(Viewing(ids, sc, bs), SamplingParams(max_tokens=steps, ignore_eos=True))
        engine.prefill_synthetic(req, generator=torch.Generator().manual_seed(1))
        while req.prefilled < len(req.prompt_ids):
            engine.step()
        arms.append((engine, req, []))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    i = 0
    while any(r.finish_reason is None for _, r, _ in arms):
        for engine, req, times in arms if i % 2 == 0 else arms[::-1]:
            if req.finish_reason is None:
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                times.append(time.perf_counter() - t0)
        i += 1
    (_, da_req, da_t), (_, full_req, full_t) = arms
    da_t, full_t = da_t[1:], full_t[1:]  # the first is the prompt's last token
    ratio = statistics.median(a / b for a, b in zip(da_t, full_t, strict=False))
    kept = len(scope.kept_blocks(prompt_len, bs)) / -(-prompt_len // bs)
    line = (f"{len(da_t)} steps at {prompt_len:,} tokens: DA median "
            f"{statistics.median(da_t) * 1e3:.2f} ms, full {statistics.median(full_t) * 1e3:.2f}"
            f" ms, median step ratio {ratio:.2f}x; blocks kept {kept:.0%}")
    if not ratio < 1.0:
        raise AssertionError(f"reading fewer blocks is not faster: {line}")
    return line


# -- 4: compaction against a reference, on every device --------------------------------
def _compaction_case(device: torch.device) -> str:
    import torch.nn.functional as F

    from declattn.vllm.compact import compact_rows

    g = torch.Generator().manual_seed(1)
    bs, heads, dim, n_blocks, width = 16, 4, 64, 96, 24
    pool_k = torch.randn(n_blocks, bs, heads, dim, generator=g).to(device)
    pool_v = torch.randn(n_blocks, bs, heads, dim, generator=g).to(device)
    table = torch.randperm(n_blocks, generator=g)[: 3 * width].reshape(3, width)
    table = table.to(torch.int32).to(device)
    lengths = {0: 370, 2: 201}
    seq_lens = torch.tensor([370, 150, 201], dtype=torch.int32).to(device)
    kept = {0: [0, 3, 4, 5, 11, 23], 2: [0, 1, 12]}
    out = compact_rows(table, seq_lens, lengths, kept, bs)
    q = torch.randn(heads, 1, dim, generator=g).to(device)
    worst = 0.0
    for row, blocks in kept.items():
        n = int(out.seq_lens[row])  # a paged kernel's read: compacted table, new length
        ids = out.block_table[row, : -(-n // bs)].long()
        k = pool_k[ids].reshape(-1, heads, dim)[:n].transpose(0, 1)
        v = pool_v[ids].reshape(-1, heads, dim)[:n].transpose(0, 1)
        got = F.scaled_dot_product_attention(q, k, v)
        # the reference: gather the kept logical blocks from the original table
        ref_ids = table[row, blocks].long()
        k_ref = pool_k[ref_ids].reshape(-1, heads, dim)
        v_ref = pool_v[ref_ids].reshape(-1, heads, dim)
        last = lengths[row] - blocks[-1] * bs  # the newest block's fill
        cut = (len(blocks) - 1) * bs + last
        want = F.scaled_dot_product_attention(q, k_ref[:cut].transpose(0, 1),
                                              v_ref[:cut].transpose(0, 1))
        worst = max(worst, float((got - want).abs().max()))
    if worst > 1e-5:
        raise AssertionError(f"compacted read differs from the reference by {worst:g}")
    if not torch.equal(out.block_table[1], table[1]):
        raise AssertionError("a row that was not compacted changed")
    return f"{device.type}: max |diff| {worst:.1e}"


@check("compact_rows == gather + SDPA reference (CPU here; CUDA where present)")
def compaction_vs_reference(args: argparse.Namespace) -> str:
    parts = [_compaction_case(torch.device("cpu"))]
    if torch.cuda.is_available():
        parts.append(_compaction_case(torch.device("cuda")))
    else:
        parts.append("cuda: skipped (no CUDA device)")
    return "; ".join(parts)


# -- 5: vLLM with the plugin ----------------------------------------------------------
def _vllm_run(spec: dict[str, Any], env: dict[str, str], tmp: Path, name: str) -> list[dict]:
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "declattn.vllm.offline", str(tmp / f"{name}.json"),
             str(tmp / f"{name}.out.json")],
            env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, timeout=420,
        ).returncode
    if rc != 0:
        raise AssertionError(f"vLLM run {name} failed (rc {rc}): {log.read_text()[-2000:]}")
    return json.loads((tmp / f"{name}.out.json").read_text())


def _find_phrase(chunks: Any, chunk_id: int) -> tuple[str, tuple[int, ...]]:
    """Three words of chunk ``chunk_id`` whose find focus the reader accepts, with the
    chunks it resolves to (a repeated text may name several)."""
    from declattn.protocol.find import PhraseFinder

    finder = PhraseFinder([c.text for c in chunks])
    words = chunks[chunk_id - 1].text.split()
    for i in range(len(words) - 2):
        phrase = " ".join(words[i : i + 3])
        res = finder.resolve(phrase)
        if all(w.isalpha() for w in words[i : i + 3]) and res.accepted and chunk_id in res.ids:
            return phrase, res.ids
    raise AssertionError(f"no phrase of chunk {chunk_id} is accepted")


STREAM_BUDGET = 4


@check("vLLM (CUDA) + plugin: reads restricted (ids, find, streaming), global DA == plain, "
       "eager == piecewise, full graphs flagged")
def vllm_plugin(args: argparse.Namespace) -> str:
    dev = _device(args)
    try:
        import vllm
    except ImportError as e:
        raise Skip(f"vLLM is not importable here ({e})") from e
    from declattn.bench.transcript import QUESTION, repeated_essay
    from declattn.da.options import DAOptions
    from declattn.vllm.offline import served_model
    from declattn.vllm.request import build_request
    from declattn.vllm.xargs import StreamingSpec

    try:
        served = served_model(args.model)
    except Exception as e:  # the model's files or its package are not on this machine
        raise Skip(f"model {args.model!r} is not available here ({type(e).__name__}: {e})") \
            from e
    tok = served.tokenizer
    context = repeated_essay(tok, 2500)
    options = DAOptions(target=256, cap=320)
    focus = tok.encode('<focus magic_chunks="2">\nThe', add_special_tokens=False)
    forced = build_request(context, QUESTION, tok, options, force=focus, label="forced")
    free = build_request(context, QUESTION, tok, options, label="free")
    phrase, found = _find_phrase(free.chunks, 2)
    find_force = tok.encode(f'<focus find="{phrase}">\nThe', add_special_tokens=False)
    find = build_request(context, QUESTION, tok, options, force=find_force, label="find")
    stream = StreamingSpec(len(free.prompt_token_ids), STREAM_BUDGET, options.sink,
                           label="stream")
    base = {"temperature": 0.0, "max_tokens": 40, "logprobs": 0, "ignore_eos": True}
    requests = [
        {"prompt_token_ids": forced.prompt_token_ids,
         "params": {**base, "extra_args": forced.extra_args}},
        {"prompt_token_ids": free.prompt_token_ids,
         "params": {**base, "extra_args": free.extra_args}},
        {"prompt_token_ids": free.prompt_token_ids, "params": dict(base)},
        {"prompt_token_ids": find.prompt_token_ids,
         "params": {**base, "extra_args": find.extra_args}},
        {"prompt_token_ids": free.prompt_token_ids,
         "params": {**base, "extra_args": stream.to_args()}},
    ]
    bs = 16 if dev.type == "cuda" else 32  # vLLM's CPU kernel takes multiples of 32
    llm: dict[str, Any] = {"dtype": "bfloat16", "block_size": bs, "max_model_len": 4096,
                           "gpu_memory_utilization": 0.3}
    if dev.type == "cpu":
        llm = {"dtype": "float32", "block_size": bs, "max_model_len": 4096}
    eager = {**llm, "enforce_eager": True}
    compiled = {**llm, "enforce_eager": False}
    piecewise = {**compiled, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = str(served.directory)
        plain = _vllm_run({"model": model, "llm": eager, "requests": requests},
                          {"VLLM_PLUGINS": ""}, tmp, "plain")
        da = _vllm_run({"model": model, "llm": eager, "requests": requests}, {}, tmp, "eager")
        pw = full = None
        if dev.type == "cuda":  # CUDA graphs exist only there
            pw = _vllm_run({"model": model, "llm": piecewise, "requests": requests}, {}, tmp,
                           "piecewise")
            full = _vllm_run({"model": model, "llm": compiled, "requests": requests[:1]}, {},
                             tmp, "default-graphs")
    lines = [f"vLLM {vllm.__version__}, {model}"]
    reads = da[0]["da"]["reads"]
    read = sum(len(r["logical"]) for r in reads)
    total = sum(-(-r["length"] // bs) for r in reads)
    if not reads or read >= total or da[0]["da"]["report"]["reads_restricted"] is not True:
        raise AssertionError(f"eager: reads not restricted ({read} of {total}): {da[0]['da']}")
    lines.append(f"eager: {read} of {total} blocks over {len(reads)} steps")
    find_reads = [r for r in da[3]["da"]["reads"] if r["mode"] == "focus"]
    if not find_reads or tuple(find_reads[0]["focus_ids"]) != found or any(
            len(r["logical"]) >= -(-r["length"] // bs) for r in find_reads):
        raise AssertionError(f"find {phrase!r}: not focused on {found}: {da[3]['da']}")
    lines.append(f"find {phrase!r}: focus on {list(found)} at {len(find_reads)} steps")
    stream_reads = da[4]["da"]["reads"]
    if not stream_reads or any(len(r["logical"]) != STREAM_BUDGET for r in stream_reads):
        raise AssertionError(f"streaming: not {STREAM_BUDGET} blocks a step: {da[4]['da']}")
    lines.append(f"streaming: {STREAM_BUDGET} blocks at each of {len(stream_reads)} steps")
    steps = [r["mode"] for r in da[1]["da"]["reads"]]
    n_global = next((i for i, m in enumerate(steps) if m != "global"), len(steps))
    same = da[1]["token_ids"][: n_global + 1] == plain[2]["token_ids"][: n_global + 1]
    if n_global < 8 or not same:
        raise AssertionError(f"global DA vs plain: {n_global} global steps, ids equal {same}")
    lines.append(f"global DA == plain over {n_global + 1} tokens")
    if pw is None or full is None:
        lines.append("CUDA graphs (piecewise == eager, full flagged): skipped on the CPU")
        return "; ".join(lines)
    for k in (0, 3, 4):  # forced ids, forced find, streaming
        blocks = [[r["logical"] for r in run[k]["da"]["reads"]] for run in (pw, da)]
        if pw[k]["token_ids"] != da[k]["token_ids"] or blocks[0] != blocks[1]:
            raise AssertionError(f"piecewise CUDA graphs and eager differ (ids or blocks) "
                                 f"for request {k}")
    lines.append("piecewise == eager (ids and blocks; ids, find and streaming requests)")
    report = full[0].get("da", {}).get("report", {})
    if report.get("reads_restricted") is not False or not any(
            "full CUDA graphs" in b for b in report.get("blockers", [])):
        raise AssertionError(f"default (full) CUDA graphs were not flagged: {report}")
    lines.append("default full graphs: flagged, reads_restricted false")
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the model of the vLLM check")
    p.add_argument("--strict", action="store_true", help="a skipped check fails the run")
    p.add_argument("--only", default="", help="comma list of check numbers (1-5) to run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of checks 1-3 and 5 on the CPU (their logic, not a "
                   "GPU result)")
    args = p.parse_args(argv)
    only = {int(x) for x in args.only.split(",") if x.strip()}
    results = []
    t_all = time.perf_counter()
    for i, (title, fn) in enumerate(CHECKS, start=1):
        if only and i not in only:
            continue
        t0 = time.perf_counter()
        try:
            status, detail = "PASS", fn(args)
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # a failed check reports and the others still run
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        seconds = time.perf_counter() - t0
        results.append((i, status, title, detail, seconds))
        print(f"[{status}] {i}. {title} ({seconds:.1f} s)\n       {detail}", flush=True)
    total = time.perf_counter() - t_all
    print("\nsummary:", ", ".join(f"{i}:{s}" for i, s, *_ in results), f"in {total:.0f} s")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"machine: {device}; torch {torch.__version__}; date {time.strftime('%Y-%m-%d')}")
    failed = [r for r in results if r[1] == "FAIL" or (args.strict and r[1] == "SKIP")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
