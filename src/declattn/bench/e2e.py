"""End to end: one forced DA transcript decoded under DA masking and under vanilla.

Both arms use the same DA prompt (rendered by ``DASession``, so the layout and the views
are the real ones) and the same teacher-forced output; vanilla is the DA-nm arm (view
``None``: every block read). The two run in one process, step for step in alternation
(the order flipping every step), so a neighbour's load falls on both alike; process
CPU time is kept beside wall time. The KV of the prompt is synthetic except its last
token (``PagedEngine.prefill_synthetic``): a step's cost does not depend on the values
it reads. The measured ratio is set beside the ratio a roofline predicts from the
bytes each arm read (weights and KV alike).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from declattn.api import DEFAULT_PREFILL_CHUNK, Engine
from declattn.api.session import DASession
from declattn.bench.transcript import QUESTION, fact_chunk, forced_transcript, repeated_essay
from declattn.da.options import DAOptions
from declattn.engine.controller import Forced
from declattn.engine.loader import LoadedModel
from declattn.engine.models import Decoder, ModelConfig
from declattn.engine.request import Request
from declattn.engine.sampler import SamplingParams


def kv_heavy_config(
    vocab_size: int, max_positions: int, *, layers: int = 2, kv_heads: int = 8, head_dim: int = 128
) -> ModelConfig:
    """A small model whose decode step is mostly KV reads: few thin layers, wide KV."""
    return ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": layers,
            "num_attention_heads": 4 * kv_heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab_size,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": max_positions,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        }
    )


def random_model(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(dtype).eval()


def weight_bytes_per_step(model: Decoder) -> int:
    """Bytes of weights one decode step reads: every matrix once; of the embedding only
    one row, unless it doubles as the output projection (tied), which reads it whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed.weight
        total -= emb.numel() * emb.element_size()
    return total


@dataclass(frozen=True)
class E2EConfig:
    context_tokens: int
    output_tokens: int = 160
    block_size: int = 16
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Arm:
    name: str
    engine: Engine
    session: DASession
    seq: Request
    times: list[float]
    cpu: list[float]


def no_attention(layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                 window: int | None) -> Tensor:
    """An ``AttentionFn`` that reads nothing (returns ``q``): what is left of a step is
    the weights and the rest."""
    return q


def null_attention_step(model: Decoder, position: int, reps: int = 5) -> float:
    """Median seconds of one decode step's model work without attention (q returned)."""
    ids, pos = torch.tensor([0]), torch.tensor([position])
    samples = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model.logits(model(ids, pos, no_attention))
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def run_e2e(
    name: str,
    engine: Engine,
    cfg: E2EConfig,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Decode the forced transcript with DA and with vanilla masking; see module doc."""
    model, tokenizer = engine.loaded.model, engine.tokenizer
    text = repeated_essay(tokenizer, cfg.context_tokens)
    base = DAOptions(constrain=False, runaway=False)
    sessions = {
        "da": DASession(tokenizer, text, QUESTION, base, cfg.block_size),
        "vanilla": DASession(
            tokenizer, text, QUESTION, DAOptions(constrain=False, runaway=False, masking=False),
            cfg.block_size,
        ),
    }
    prompt = sessions["da"].prompt_ids
    if sessions["vanilla"].prompt_ids != prompt:
        raise AssertionError("the two arms must share one prompt")
    k = fact_chunk(sessions["da"].chunks)
    n_chunks = len(sessions["da"].chunks)
    focus = (1,) if n_chunks == 1 else (k, k + 1) if k < n_chunks else (k - 1, k)
    transcript = forced_transcript(tokenizer, focus, cfg.output_tokens)
    tokens = tokenizer.encode(transcript, add_special_tokens=False)
    total = len(prompt) + len(tokens)
    if model.config.max_position_embeddings < total:
        raise ValueError(
            f"{name}: {total} positions exceed the model's {model.config.max_position_embeddings}"
        )
    if log is not None:
        log(f"{name}: prompt {len(prompt):,} tokens, {n_chunks} chunks, output {len(tokens)}")
    arms: list[_Arm] = []
    for arm_name, sess in sessions.items():
        eng = Engine(
            engine.loaded,
            kv_tokens=total + 2 * cfg.block_size,
            block_size=cfg.block_size,
            prefill_chunk=cfg.prefill_chunk,
            kv_disk=False,  # synthetic K/V: a cached prefix would stand in its way
        )
        params = SamplingParams(max_tokens=len(tokens), ignore_eos=True)
        seq = eng.add(Forced(sess, tokens), params)
        eng.prefill_synthetic(seq, generator=torch.Generator().manual_seed(cfg.seed))
        while seq.prefilled < len(seq.prompt_ids):
            eng.step()
        arms.append(_Arm(arm_name, eng, sess, seq, [], []))
    i = 0
    while any(a.seq.finish_reason is None for a in arms):
        order = arms if i % 2 == 0 else arms[::-1]
        for a in order:
            if a.seq.finish_reason is None:
                c0, t0 = time.process_time(), time.perf_counter()
                a.engine.step()
                a.times.append(time.perf_counter() - t0)
                a.cpu.append(time.process_time() - c0)
        i += 1
    da, van = arms
    if da.seq.output_ids != van.seq.output_ids or da.seq.output_ids != tokens:
        raise AssertionError("both arms must emit the forced transcript")
    w = weight_bytes_per_step(model)
    kv = {a.name: [r.global_bytes + r.sliding_bytes for r in a.seq.reads] for a in arms}
    steps = len(da.times)
    by_mode: dict[str, list[int]] = {}
    for idx, rec in enumerate(da.session.steps):
        by_mode.setdefault(str(rec.mode), []).append(idx)
    modes = {}
    for mode, idxs in by_mode.items():
        modes[mode] = {
            "steps": len(idxs),
            "share": len(idxs) / steps,
            "da_median_seconds": statistics.median(da.times[j] for j in idxs),
            "vanilla_median_seconds": statistics.median(van.times[j] for j in idxs),
            "da_median_cpu_seconds": statistics.median(da.cpu[j] for j in idxs),
            "vanilla_median_cpu_seconds": statistics.median(van.cpu[j] for j in idxs),
            "da_kv_bytes": sum(kv["da"][j] for j in idxs),
            "vanilla_kv_bytes": sum(kv["vanilla"][j] for j in idxs),
        }
    da_s, van_s = sum(da.times), sum(van.times)
    predicted = (steps * w + sum(kv["da"])) / (steps * w + sum(kv["vanilla"]))
    final_len = len(prompt) + len(tokens) - 1
    null_step = null_attention_step(model, final_len)
    tail = van.times[-max(1, min(10, steps)) :]
    vanilla_last = statistics.median(tail)
    return {
        "model": name,
        "config": cfg.to_dict(),
        "prompt_tokens": len(prompt),
        "output_tokens": len(tokens),
        "decode_steps": steps,
        "n_chunks": n_chunks,
        "fact_chunk": k,
        "focus": list(focus),
        "kv_prefill": "synthetic (all prompt positions but the last)",
        "weight_bytes_per_step": w,
        "kv_bytes_per_token_all_layers": da.engine.pool.bytes_per_token
        * model.config.num_layers,
        "da_decode_seconds": da_s,
        "vanilla_decode_seconds": van_s,
        "measured_ratio": da_s / van_s,
        "measured_ratio_median_step": statistics.median(
            d / v for d, v in zip(da.times, van.times, strict=True)
        ),
        "da_decode_cpu_seconds": sum(da.cpu),
        "vanilla_decode_cpu_seconds": sum(van.cpu),
        "measured_cpu_ratio": sum(da.cpu) / sum(van.cpu),
        "predicted_ratio_roofline": predicted,
        "da_bytes": steps * w + sum(kv["da"]),
        "vanilla_bytes": steps * w + sum(kv["vanilla"]),
        "attention_share_of_vanilla_step": max(0.0, 1.0 - null_step / vanilla_last),
        "vanilla_step_seconds_at_end": vanilla_last,
        "non_attention_step_seconds": null_step,
        "modes": modes,
        "saving": da.session.accounting.totals()["physical_saving"],
    }


def engine_over(model: Decoder, tokenizer: Any) -> Engine:
    """The facade over a model built in memory (the random KV-heavy one)."""
    return Engine(LoadedModel(model, model.config, tokenizer, Path("<random weights>")))

