"""``da-lora``: a real model (qwen2.5-0.5b, smollm2-135m) taught to declare with LoRA.

The base GGUF is loaded with dense weights (dequantised from its blocks, in bf16: the
engine's packed layers cannot train) and its attention and MLP projections get LoRA
adapters (``lora.py``). Training data is generated on the fly from the training part of
the corpora (``lora_tasks.py``), encoded as the engine's exact prompts with the DA mask
of the target replies (``lora_data.py``), and each sequence is one forward in two passes
(``prefix.py``). Sequences are a pure function of the run's seed and their index, so a
resumed run sees the same data as one that never stopped.

The output directory holds the adapter (``adapter_model.safetensors`` and
``adapter_config.json``), the protocol settings the model is served with
(``declattn.json``) and the run (``training.json``: spec, command, data sizes, losses,
wall time, load average); ``checkpoint.pt`` while the run is unfinished.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from declattn.corpora.build import TaskData
from declattn.da.options import MODEL_SETTINGS_FILE, DAOptions
from declattn.engine.loader import LoadedModel, load_model
from declattn.protocol.instruction import BRIEF_INSTRUCTION
from declattn.train.lora import LoRASpec, apply_lora, save_adapter, trainable
from declattn.train.lora_data import SeqExample, encode_case
from declattn.train.lora_tasks import GENERATORS
from declattn.train.prefix import two_pass_loss

CHECKPOINT = "checkpoint.pt"
TRAINING_FILE = "training.json"
DEFAULT_MIX = {
    "planted": 0.2, "needle": 0.14, "squad": 0.18, "hotpot": 0.1, "compare": 0.08,
    "bridge": 0.08, "agentic": 0.17, "survey": 0.05,
}


@dataclass(frozen=True)
class LoRARun:
    """Everything a run depends on; written to ``training.json``."""

    base: str = "qwen2.5-0.5b"
    seed: int = 0
    steps: int = 60
    batch: int = 4  # sequences per optimiser step
    lr: float = 1.5e-3
    warmup: int = 6
    floor: float = 0.1
    min_context: int = 1000
    max_context: int = 2000
    chunk_target: int = 512
    chunk_cap: int = 640
    sink: int = 16
    heldout: int = 6
    heldout_every: int = 30
    checkpoint_every: int = 5
    rank: int = 8
    alpha: float = 16.0
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))

    def options(self) -> DAOptions:
        """The protocol settings the trained model is served with."""
        return DAOptions(
            target=self.chunk_target, cap=self.chunk_cap, sink=self.sink,
            instruction=BRIEF_INSTRUCTION, focus="find", scaffold_local=True,
        )

    def lora(self) -> LoRASpec:
        return LoRASpec(rank=self.rank, alpha=self.alpha)


class RunMismatch(ValueError):
    """The output directory holds a checkpoint of a run with other settings."""


class Stream:
    """Training sequences by index: sequence ``i`` of seed ``s`` is always the same."""

    def __init__(self, run: LoRARun, tokenizer: Any, salt: str) -> None:
        self.run, self.tokenizer, self.salt = run, tokenizer, salt
        self.data = TaskData.for_tokenizer(tokenizer, part="train")
        self.options = run.options()
        kinds = [k for k, w in run.mix.items() if w > 0]
        unknown = [k for k in kinds if k not in GENERATORS]
        if unknown:
            raise ValueError(f"unknown task kinds {unknown}; known: {', '.join(GENERATORS)}")
        self.kinds, self.weights = kinds, [run.mix[k] for k in kinds]

    def example(self, index: int) -> SeqExample:
        rng = random.Random(f"da-lora/{self.salt}/{self.run.seed}/{index}")
        while True:  # a case none of whose questions gets a target is drawn again
            kind = rng.choices(self.kinds, self.weights)[0]
            tokens = rng.randint(self.run.min_context, self.run.max_context)
            case = GENERATORS[kind](self.data, rng, tokens)
            e = encode_case(self.tokenizer, case, self.options, rng)
            if e is not None:
                return e


def lr_at(run: LoRARun, step: int) -> float:
    """Linear warm-up, then cosine down to ``floor`` of the peak."""
    if step < run.warmup:
        return run.lr * (step + 1) / run.warmup
    t = (step - run.warmup) / max(1, run.steps - run.warmup)
    return run.lr * (run.floor + (1 - run.floor) * 0.5 * (1 + math.cos(math.pi * t)))


def load_base(name: str) -> LoadedModel:
    """The base model with dense bf16 weights (dequantised from the GGUF's blocks)."""
    from declattn.engine.registry import resolve_model

    return load_model(resolve_model(name), dtype=torch.bfloat16, quantize=False)


def heldout_loss(model: Any, examples: list[SeqExample]) -> float:
    """Mean cross-entropy per reply token over ``examples``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            loss, n = two_pass_loss(model, torch.tensor(e.input_ids), torch.tensor(e.labels),
                                    e.mask, e.frozen)
            total, count = total + float(loss), count + n
    return total / max(1, count)


@dataclass
class Progress:
    """What the caller is told as the run goes (for a progress bar)."""

    on_step: Callable[[int, float, float], None] | None = None  # step, loss, lr
    on_heldout: Callable[[int, float], None] | None = None  # step, held-out loss


def train_da_lora(
    run: LoRARun, out: Path, progress: Progress | None = None, command: str = ""
) -> dict[str, Any]:
    """Train (or resume) into ``out``; returns what ``training.json`` records."""
    progress = progress or Progress()
    t0 = time.perf_counter()
    loads = [os.getloadavg()[0]]
    loaded = load_base(run.base)
    model, tok = loaded.model, loaded.tokenizer
    apply_lora(model, run.lora(), seed=run.seed)
    params = trainable(model)
    opt = torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.99), weight_decay=0.0)
    state = _resume(out, run, model, opt)
    stream, held = Stream(run, tok, "train"), Stream(run, tok, "heldout")
    heldout = [held.example(i) for i in range(run.heldout)]
    log, evals = state["log"], state["evals"]
    if not evals:
        evals.append({"step": 0, "loss": round(heldout_loss(model, heldout), 4)})
        if progress.on_heldout:
            progress.on_heldout(0, evals[-1]["loss"])
    model.train()
    sizes = state["sizes"]
    for step in range(state["step"], run.steps):
        lr = lr_at(run, step)
        for g in opt.param_groups:
            g["lr"] = lr
        total, count = torch.zeros(()), 0
        opt.zero_grad(set_to_none=True)
        batch = [stream.example(step * run.batch + k) for k in range(run.batch)]
        n_tokens = sum(e.reply_tokens for e in batch)
        for e in batch:
            loss, n = two_pass_loss(model, torch.tensor(e.input_ids), torch.tensor(e.labels),
                                    e.mask, e.frozen)
            (loss / n_tokens).backward()
            total, count = total + loss.detach(), count + n
            sizes["sequences"] += 1
            sizes["tokens"] += len(e.input_ids)
            sizes["reply_tokens"] += n
            for k in e.kinds:
                sizes["questions"][k] = sizes["questions"].get(k, 0) + 1
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(total) / max(1, count)
        loads.append(os.getloadavg()[0])
        log.append({"step": step, "loss": round(value, 4),
                    "seconds": round(state["seconds"] + time.perf_counter() - t0, 1)})
        if progress.on_step:
            progress.on_step(step, value, lr)
        last = step + 1 == run.steps
        if (step + 1) % run.heldout_every == 0 or last:
            model.eval()
            evals.append({"step": step + 1, "loss": round(heldout_loss(model, heldout), 4)})
            model.train()
            if progress.on_heldout:
                progress.on_heldout(step + 1, evals[-1]["loss"])
        if (step + 1) % run.checkpoint_every == 0 or last:
            state.update(step=step + 1, seconds=state["seconds"] + time.perf_counter() - t0)
            t0 = time.perf_counter()
            _checkpoint(out, run, model, opt, state)
    model.eval()
    record = _record(run, state, loads, command)
    _finish(out, run, model, loaded, record)
    return record


def _fresh_state() -> dict[str, Any]:
    return {"step": 0, "seconds": 0.0, "log": [], "evals": [],
            "sizes": {"sequences": 0, "tokens": 0, "reply_tokens": 0, "questions": {}}}


def _resume(out: Path, run: LoRARun, model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    path = out / CHECKPOINT
    if not path.is_file():
        return _fresh_state()
    ck = torch.load(path, weights_only=False)
    if ck["run"] != asdict(run):
        raise RunMismatch(f"{path} is a checkpoint of a run with other settings; use "
                          "another --out, or the options of that run to resume it")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in ck["lora"].items():
            params[name].copy_(t)
    opt.load_state_dict(ck["optimizer"])
    return ck["state"]


def _checkpoint(out: Path, run: LoRARun, model: Any, opt: torch.optim.Optimizer,
                state: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save({"run": asdict(run), "lora": lora, "optimizer": opt.state_dict(),
                "state": state}, tmp)
    os.replace(tmp, out / CHECKPOINT)


def _record(run: LoRARun, state: dict[str, Any], loads: list[float], command: str) -> dict:
    return {
        "run": asdict(run), "command": command, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "seconds": round(state["seconds"], 1),
        "load_average": {"start": loads[0], "mean": round(sum(loads) / len(loads), 2),
                         "max": max(loads)},
        "data": state["sizes"], "heldout": state["evals"], "log": state["log"],
    }


def _finish(out: Path, run: LoRARun, model: Any, loaded: LoadedModel, record: dict) -> None:
    save_adapter(model, loaded.config, run.lora(), out, run.base)
    o = run.options()
    settings = {"da": {"target": o.target, "cap": o.cap, "sink": o.sink, "style": o.style,
                       "focus": o.focus, "instruction": o.instruction,
                       "scaffold_local": o.scaffold_local}}
    (out / MODEL_SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    (out / TRAINING_FILE).write_text(json.dumps(record, indent=1) + "\n")
    (out / CHECKPOINT).unlink(missing_ok=True)


def with_overrides(run: LoRARun, **changes: Any) -> LoRARun:
    """``run`` with the given fields replaced (``None`` values left as they are)."""
    return replace(run, **{k: v for k, v in changes.items() if v is not None})
