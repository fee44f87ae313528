"""``declattn bench peers``: declattn against llama.cpp on the same GGUF, side by side.

What a CPU user with a GGUF file would run instead of us is llama.cpp, so this is the bar
for decode speed. Both engines stay loaded in long-lived processes (llama.cpp in its own
environment, ``llama_worker.py``; declattn in this one), get the same prompt token ids
(rendered once by a DA session) and the same teacher-forced output ids, and run one at a
time, interleaved: each repeat decodes a block of tokens on every arm in turn, the order
rotating between repeats, with a memory-bandwidth sample after each block (the same
minutes, the same neighbours). Figures are medians over the repeats.

Arms: llama.cpp with flash attention on and off; declattn vanilla (every KV block read)
and declattn DA in a focus that keeps about ``focus_share`` of the context (the chunk
size is set so that one chunk is that share; the steps timed are all in focus, which
the session's own record checks). Prefill is real and timed for llama.cpp and declattn
vanilla; the DA arm's KV is synthetic (``prefill_synthetic``: a step's cost does not
depend on the values it reads) since its prompt is the same. ``compare`` adds the
declattn arms of other models with the same tokenizer to the same interleaved repeats
(``qwen2.5-0.5b-da`` beside ``qwen2.5-0.5b``: does the merged adapter cost a decode step
anything?), named after their model.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from declattn.api import Engine
from declattn.api.session import DASession
from declattn.bench.e2e import no_attention
from declattn.bench.machine import BandwidthProbe, machine_info
from declattn.bench.transcript import QUESTION, fact_chunk, repeated_essay
from declattn.da.options import DAOptions
from declattn.engine.controller import Forced
from declattn.engine.registry import resolve_model
from declattn.engine.sampler import SamplingParams
from declattn.engine.threads import load_average
from declattn.protocol.modes import Mode

WORKER = Path(__file__).with_name("llama_worker.py")
FILLER = "Reading the chunk closely for the vault code of the north tower. "
WARMUP_STEPS = 2  # decoded on every arm before timing (after the focus tag)


@dataclass(frozen=True)
class PeersConfig:
    """What to run. ``prefill_threads``: thread counts that prefill is timed at (each a
    fresh prefill; ``None``: every value of ``threads``). ``compare``: other declattn
    models (``model``'s tokenizer) timed beside ``model``'s declattn arms."""

    model: str = "qwen2.5-0.5b"
    compare: tuple[str, ...] = ()
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    threads: tuple[int, ...] = (1, 2)
    prefill_threads: tuple[int, ...] | None = None
    repeats: int = 3
    decode_tokens: int = 16
    focus_share: float = 0.125
    dtype: str = "auto"
    flash_attn: tuple[bool, ...] = (True, False)
    llama_python: str | None = ".venv-bench/bin/python"
    block_size: int = 16
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LlamaWorker:
    """The llama.cpp process: one JSON line per request and per answer."""

    def __init__(self, python: str) -> None:
        if not Path(python).is_file():
            raise FileNotFoundError(
                f"{python}: no bench environment; build it with `make bench-env` "
                "(llama-cpp-python compiled for this CPU, a few minutes)"
            )
        self.proc = subprocess.Popen(
            [python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (status {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp worker: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


@dataclass
class Arm:
    """One engine configuration and what it measured at the current context."""

    name: str
    prefill_seconds: dict[int, float] = field(default_factory=dict)  # threads -> seconds
    steps: dict[int, list[list[float]]] = field(default_factory=dict)  # threads -> blocks
    kv_bytes: list[int] = field(default_factory=list)  # per timed step (declattn arms)
    engine: Any = None
    seq: Any = None
    session: Any = None
    fa: bool | None = None  # llama.cpp arms
    weights_only: bool = False  # declattn's step with attention left out (q returned)
    position: int = 0  # the weights-only arm's token position

    def decode_ms(self, threads: int) -> float:
        """Median over repeats of each block's median step, in milliseconds."""
        return 1e3 * statistics.median(statistics.median(b) for b in self.steps[threads])


def gguf_bytes_per_step(path: Path) -> int:
    """Weight bytes llama.cpp reads per token: every tensor, except the embedding table
    when a separate output matrix exists (then only one of its rows is read)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def _prompt(
    tok: Any, max_positions: int, context: int, cfg: PeersConfig
) -> tuple[dict, list[int], int]:
    """DA and vanilla sessions over a ``context``-token document, and the forced output:
    a focus tag on the fact's chunk, then filler. The prompt and the forced output fit
    ``max_positions`` (32,768 for Qwen2.5)."""
    target = max(256, round(context * cfg.focus_share))
    opts = dict(target=target, cap=target + target // 4, constrain=False, runaway=False)
    need = WARMUP_STEPS + len(cfg.threads) * cfg.repeats * cfg.decode_tokens + 8
    length = min(context, max_positions - need - 64)  # 64: room for the focus tag
    if length < 256:
        raise ValueError(
            f"{need:,} decoded tokens (--repeats x --decode-tokens per thread "
            f"count) leave no room for a document in the model's {max_positions:,} positions"
        )
    doc = length
    for _ in range(8):  # take the scaffold's tokens, and any last paragraph's, off the doc
        text = repeated_essay(tok, doc)
        da = DASession(tok, text, QUESTION, DAOptions(**opts), cfg.block_size)
        over = len(da.prompt_ids) - length
        if over <= 0:
            break
        doc -= over
    else:
        raise AssertionError(f"no document of {context:,} tokens fits {max_positions:,}")
    sessions = {
        "da": da,
        "vanilla": DASession(
            tok, text, QUESTION, DAOptions(**opts, masking=False), cfg.block_size
        ),
    }
    k = fact_chunk(sessions["da"].chunks)
    tag = tok.encode(f'<focus magic_chunks="{k}">', add_special_tokens=False)
    filler = tok.encode(FILLER * (need // 8 + 2), add_special_tokens=False)
    return sessions, tag + filler[:need], len(tag)


def _declattn_arm(engine: Engine, name: str, sess: DASession, tokens: list[int], cfg) -> Arm:
    total = len(sess.prompt_ids) + len(tokens) + 2 * cfg.block_size
    eng = Engine(engine.loaded, kv_tokens=total, block_size=cfg.block_size, prefix_caching=False)
    seq = eng.add(Forced(sess, tokens), SamplingParams(max_tokens=len(tokens), ignore_eos=True))
    return Arm(name, engine=eng, seq=seq, session=sess)


def _prefill(arm: Arm, synthetic: bool, seed: int) -> float:
    eng, seq = arm.engine, arm.seq
    t0 = time.perf_counter()
    if synthetic:
        eng.prefill_synthetic(seq, generator=torch.Generator().manual_seed(seed))
    while seq.prefilled < len(seq.prompt_ids):
        eng.step()
    return time.perf_counter() - t0


def _decode_block(arm: Arm, worker: LlamaWorker | None, tokens: list[int], threads: int):
    """Decode ``tokens`` (the ids fed, one per step) on ``arm``; seconds per step."""
    if arm.fa is not None:
        assert worker is not None
        return worker.call(cmd="decode", fa=arm.fa, threads=threads, tokens=tokens)["seconds"]
    torch.set_num_threads(threads)
    times = []
    if arm.weights_only:
        model, pos = arm.engine.loaded.model, torch.tensor([arm.position])
        with torch.inference_mode():
            for tok in tokens:
                t0 = time.perf_counter()
                model.logits(model(torch.tensor([tok]), pos, no_attention))
                times.append(time.perf_counter() - t0)
        return times
    for want in tokens:
        if arm.seq.output_ids[-1] != want:
            raise AssertionError(f"{arm.name}: the forced output went off script")
        t0 = time.perf_counter()
        arm.engine.step()
        times.append(time.perf_counter() - t0)
        read = arm.seq.reads[-1]
        arm.kv_bytes.append(read.global_bytes + read.sliding_bytes)
    return times


def profile_step(arm: Arm, threads: int, steps: int = 3) -> dict[str, float]:
    """Milliseconds per decode step by kind of op (torch profiler, self time): weight
    matmuls, decode attention, and the rest (norms, RoPE, sampling, the session)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            arm.engine.step()
    kinds = {"weights": 0.0, "attention": 0.0, "rest": 0.0}
    for ev in prof.key_averages():
        name = ev.key
        if name.startswith(("declattn::gguf_", "aten::_weight_int", "aten::addmm", "aten::mm")):
            kind = "weights"
        elif "attention" in name or "flash" in name:
            kind = "attention"
        else:
            kind = "rest"
        kinds[kind] += ev.self_cpu_time_total / 1e3 / steps
    return kinds


def _suffix(name: str, cfg: PeersConfig) -> str:
    """The arm-name suffix of a model's declattn arms: none for ``cfg.model``."""
    return "" if name == cfg.model else f" ({name})"


def run_context(
    engines: dict[str, Engine], worker: LlamaWorker | None, context: int, cfg: PeersConfig, log
) -> dict[str, Any]:
    """Every arm at one context length: prefills, then interleaved decode blocks.
    ``engines``: ``cfg.model``'s first, then each of ``cfg.compare``."""
    engine = engines[cfg.model]
    limit = min(e.loaded.config.max_position_embeddings for e in engines.values())
    # Each model's arms drive sessions of their own (a session records its steps).
    per_model = {m: _prompt(e.tokenizer, limit, context, cfg) for m, e in engines.items()}
    sessions, tokens, tag_len = per_model[cfg.model]
    prompt = sessions["da"].prompt_ids
    for s, t, _ in per_model.values():
        if s["vanilla"].prompt_ids != prompt or s["da"].prompt_ids != prompt or t != tokens:
            raise AssertionError("every declattn arm must share one prompt and output")
    arms = [Arm(f"llama.cpp fa={'on' if fa else 'off'}", fa=fa) for fa in cfg.flash_attn]
    if worker is None:
        arms = []
    vans = {m: _declattn_arm(e, "declattn vanilla" + _suffix(m, cfg),
                             per_model[m][0]["vanilla"], tokens, cfg) for m, e in engines.items()}
    das = {m: _declattn_arm(e, "declattn DA" + _suffix(m, cfg), per_model[m][0]["da"], tokens,
                            cfg) for m, e in engines.items()}
    log(f"context {context:,}: prompt {len(prompt):,} tokens, {len(sessions['da'].chunks)} "
        f"chunks, {len(tokens)} forced tokens")
    for t in cfg.prefill_threads or cfg.threads:
        for arm in arms:
            answer = worker.call(cmd="prefill", fa=arm.fa, threads=t, tokens=prompt)
            arm.prefill_seconds[t] = answer["seconds"]
        torch.set_num_threads(t)
        for m, van in vans.items():
            if van.seq.prefilled:  # a fresh prefill for each thread count
                timed = van.prefill_seconds
                van = vans[m] = _declattn_arm(engines[m], van.name,
                                              per_model[m][0]["vanilla"], tokens, cfg)
                van.prefill_seconds = timed
            van.prefill_seconds[t] = _prefill(van, synthetic=False, seed=cfg.seed)
        log(f"  prefill at {t} thread(s): " + ", ".join(
            f"{a.name} {len(prompt) / a.prefill_seconds[t]:.0f} tok/s"
            for a in [*arms, *vans.values()]))
    for da in das.values():
        _prefill(da, synthetic=True, seed=cfg.seed)
    for m, e in engines.items():
        bare = Arm("declattn weights only" + _suffix(m, cfg), engine=e, position=len(prompt),
                   weights_only=True)
        arms += [vans[m], das[m], bare]
    # The prefill emitted tokens[0]; step i feeds tokens[i]. Warm-up: the tag and a few.
    pos = tag_len + WARMUP_STEPS
    for arm in arms:
        _decode_block(arm, worker, tokens[:pos], cfg.threads[0])
    for arm in [*vans.values(), *das.values()]:
        arm.kv_bytes.clear()
    bandwidth: dict[int, BandwidthProbe] = {}
    for t in cfg.threads:
        torch.set_num_threads(t)
        probe = bandwidth[t] = BandwidthProbe()
        probe.sample()  # first touch
        probe.copies.clear()
        probe.reads.clear()
        for r in range(cfg.repeats):
            block = tokens[pos : pos + cfg.decode_tokens]
            pos += cfg.decode_tokens
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                arm.steps.setdefault(t, []).append(_decode_block(arm, worker, block, t))
                torch.set_num_threads(t)
                probe.sample()
        log(f"  decode at {t} thread(s): " + ", ".join(
            f"{a.name} {a.decode_ms(t):.1f} ms" for a in arms))
    for da in das.values():
        timed = da.session.steps[tag_len + WARMUP_STEPS :]
        if len(timed) != len(da.kv_bytes) or any(s.mode != Mode.FOCUS for s in timed):
            raise AssertionError(f"a timed step of {da.name} was not in focus")
    van, da = vans[cfg.model], das[cfg.model]
    result = _context_result(engine, cfg, context, prompt, arms, van, da, bandwidth)
    result["profile_ms"] = {a.name: profile_step(a, cfg.threads[0]) for a in (van, da)}
    return result


def _context_result(engine, cfg, context, prompt, arms, van, da, bandwidth) -> dict[str, Any]:
    model = engine.loaded.model
    c = model.config
    llama_weights = gguf_bytes_per_step(resolve_model(cfg.model))
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # f16 cache
    rows = []
    for arm in arms:
        if arm.fa is not None:
            weights, kv = llama_weights, kv_per_token * (len(prompt) + cfg.decode_tokens)
        else:
            weights = arm.engine.loaded.model.weight_bytes_per_step()
            kv = 0 if arm.weights_only else statistics.median(arm.kv_bytes)
        for t in cfg.threads:
            ms = arm.decode_ms(t)
            bw = bandwidth[t].result()
            rows.append({
                "arm": arm.name, "threads": t,
                "prefill_tok_s": len(prompt) / arm.prefill_seconds[t]
                if t in arm.prefill_seconds else None,
                "decode_ms": ms,
                "decode_ms_blocks": [1e3 * statistics.median(b) for b in arm.steps[t]],
                "weight_bytes": weights, "kv_bytes": kv,
                "effective_gb_s": (weights + kv) / ms / 1e6,
                "bandwidth_read_best_gb_s": bw.read_best / 1e9,
                "bandwidth_read_median_gb_s": bw.read_median / 1e9,
            })
    kept = statistics.median(da.kv_bytes) / statistics.median(van.kv_bytes)
    return {
        "context": context, "prompt_tokens": len(prompt), "chunks": len(da.session.chunks),
        "da_kv_kept_share": kept, "rows": rows,
    }


def run_peers(cfg: PeersConfig, log=print) -> dict[str, Any]:
    """The whole bench; see the module doc."""
    if cfg.model in cfg.compare or len(set(cfg.compare)) < len(cfg.compare):
        raise ValueError(f"--compare {','.join(cfg.compare)}: name each model once, "
                         "--model not among them")
    load_before = load_average()
    engine = Engine.from_pretrained(cfg.model, dtype=cfg.dtype, device="cpu")
    quant = engine.loaded.quant.to_dict() if engine.loaded.quant else None
    log(f"declattn: {cfg.model}, weights {quant['layers'] if quant else cfg.dtype}")
    engines = {cfg.model: engine}
    for name in cfg.compare:
        other = engines[name] = Engine.from_pretrained(name, dtype=cfg.dtype, device="cpu")
        if other.tokenizer.get_vocab() != engine.tokenizer.get_vocab():
            raise ValueError(f"--compare {name}: its tokenizer is not {cfg.model}'s, and the "
                             "arms must decode the same token ids")
    worker, llama = None, None
    if cfg.llama_python:
        worker = LlamaWorker(cfg.llama_python)
        n_ctx = max(cfg.contexts) + 1024  # the prompt is at most the context, plus output
        llama = worker.call(cmd="load", model=str(resolve_model(cfg.model)), n_ctx=n_ctx,
                            flash_attn=list(cfg.flash_attn), threads=cfg.threads[0])
        log(f"llama-cpp-python {llama['version']}")
    try:
        contexts = [run_context(engines, worker, n, cfg, log) for n in cfg.contexts]
    finally:
        if worker is not None:
            worker.close()
    return {
        "config": cfg.to_dict(), "machine": machine_info(),
        "load_average": {"start": load_before, "end": load_average()},
        "llama_cpp": llama, "declattn_weights": quant,
        "weight_bytes_per_step": engine.loaded.model.weight_bytes_per_step(),
        "contexts": contexts,
    }
