"""``da-tiny``: a Llama-family model trained from scratch, here, to declare.

A pre-norm Llama (4 layers, d=128, tied embeddings, a word-level vocabulary of about
1.2K) plus two learning aids, the ``declattn_tiny`` family (token shift and chunk-segment
embeddings, see ``engine/models/token_context.py``): without them a plain model of this
size stayed on a loss plateau for the whole CPU budget. Only our engine runs the family;
``TinySpec(aids=False)`` trains a plain Llama that ``transformers`` and vLLM also load.
Training holds documents short (at most ``hold_chunks`` chunks) while the lookups form,
then grows the chunk count to ``max_chunks``, with a share of 2-hop questions, and
ends with a gate: 1-hop accuracy on fresh documents, decoded by the real engine with DA
masking from the model's own tags. A run that misses the gate fails loudly
rather than writing a model that only learned the format.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from declattn.da.options import MODEL_SETTINGS_FILE
from declattn.engine.models.config import ModelConfig
from declattn.engine.models.decoder import Decoder
from declattn.train.data import Example, da_tiny_options, encode, tiny_tokenizer
from declattn.train.tasks import make_episodes
from declattn.train.trainer import Batch, Recipe, collate, train
from declattn.train.vocab import save_tokenizer


@dataclass(frozen=True)
class TinySpec:
    """Everything a da-tiny run depends on; written next to the weights."""

    seed: int = 0
    steps: int = 1500
    batch: int = 16
    max_chunks: int = 16
    hold_chunks: int = 3  # documents of at most this many chunks while the lookups form
    hold: float = 0.55  # share of steps held there (the chunk id formed at ~700-800)
    curriculum: float = 0.75  # share of steps by which the chunk count has grown to max
    two_hop: float = 0.25
    unmasked: float = 0.0  # share of sequences trained without DA masks (the vanilla arm)
    questions: int = 8  # questions (turns) per training sequence, on one document
    lr: float = 2e-3
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 512
    aids: bool = True  # token shift and chunk-segment embeddings (declattn_tiny family)
    aid_init_std: float = 0.088  # ~1/sqrt(hidden): the aids speak up from the first step
    max_chunk_id: int = 64  # the largest chunk id with its own segment embedding
    long_every: int = 4  # after the curriculum, every n-th batch has up to max_chunk_id
    gate_samples: int = 100
    gate_accuracy: float = 0.9


def hf_config(spec: TinySpec, vocab_size: int, eos_id: int) -> dict[str, Any]:
    aids = (
        {"token_shift": 2, "chunk_segments": spec.max_chunk_id}
        if spec.aids
        else {}
    )
    return {
        "architectures": ["DeclattnTinyForCausalLM" if spec.aids else "LlamaForCausalLM"],
        "model_type": "declattn_tiny" if spec.aids else "llama",
        **aids,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "head_dim": spec.hidden // spec.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "float16",
    }


def new_model(config: dict[str, Any], seed: int, aid_init_std: float = 0.02) -> Decoder:
    """Weights at std 0.02, the aids' (token shift, chunk segments) at ``aid_init_std``.

    At 0.02 the aids add a signal a quarter the size of the token's own embedding, and
    the value lookup never formed in 900 steps; at ~1/sqrt(hidden) it formed within 400
    (see docs/training.md)."""
    torch.manual_seed(seed)
    model = Decoder(ModelConfig.from_hf(config))
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            aid = name.startswith(("shift.", "segment_embed."))
            torch.nn.init.normal_(p, std=aid_init_std if aid else 0.02)
        elif "norm" in name:
            torch.nn.init.ones_(p)
    return model


class Curriculum:
    """Seeded batches whose largest chunk count grows linearly to ``spec.max_chunks``."""

    def __init__(self, spec: TinySpec, tokenizer: Any) -> None:
        self.spec, self.tokenizer = spec, tokenizer
        self.options = da_tiny_options()
        self.rng = random.Random(spec.seed)

    def max_chunks(self, step: int) -> int:
        """``hold_chunks`` for the first ``hold`` of the run, then linear growth to
        ``max_chunks`` at ``curriculum``: lookups form on short documents first."""
        s = self.spec
        held, grown = int(s.steps * s.hold), int(s.steps * s.curriculum)
        if step < held:
            return min(s.hold_chunks, s.max_chunks)
        span = max(1, grown - held)
        extra = (s.max_chunks - s.hold_chunks) * (step - held) // span
        return max(1, min(s.max_chunks, s.hold_chunks + extra))

    def example(self, n_chunks: int) -> Example:
        kinds = [n_chunks >= 2 and self.rng.random() < self.spec.two_hop]
        kinds += [self.rng.random() < self.spec.two_hop for _ in range(self.spec.questions - 1)]
        episodes = make_episodes(self.rng, n_chunks, kinds)
        # no draw at 0: the default run's random stream stays what shipped da-tiny saw
        plain = self.spec.unmasked > 0 and self.rng.random() < self.spec.unmasked
        return encode(self.tokenizer, episodes, self.options, masking=not plain)

    def __call__(self, step: int) -> Batch:
        spec = self.spec
        top, size = self.max_chunks(step), spec.batch
        grown = step >= spec.steps * spec.curriculum
        if spec.aids and spec.long_every and grown and step % spec.long_every == 0:
            # long documents train the segment embeddings of high chunk ids, in a smaller
            # batch since each sequence is up to four times as long
            top, size = spec.max_chunk_id, max(1, spec.batch // 4)
        out = []
        for _ in range(size):
            out.append(self.example(self.rng.randint(1, top)))
        return collate(out, self.tokenizer.pad_token_id)


def save(model: Decoder, config: dict[str, Any], tokenizer: Any, spec: TinySpec, out: Path,
         log: list[dict[str, float]]) -> None:
    """A Hugging Face directory: fp16 safetensors, config, tokenizer, DA settings, the run."""
    from safetensors.torch import save_file

    from declattn.engine.models.hf_names import hf_name

    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config)
    state = {}
    for name, t in model.state_dict().items():
        key = hf_name(cfg, name)
        if key is not None:
            state[key] = t.detach().to(torch.float16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tokenizer.backend_tokenizer, out)
    o = da_tiny_options()
    settings = {"da": {"target": o.target, "cap": o.cap, "sink": o.sink, "style": o.style,
                       "instruction": o.instruction, "min_context": o.min_context}}
    (out / MODEL_SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    (out / "training.json").write_text(
        # float sums depend on the thread count: a rerun matches only with the same one
        json.dumps({"spec": asdict(spec), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "log": log}, indent=1) + "\n"
    )


def train_da_tiny(
    spec: TinySpec, out: Path, on_step: Callable[[int, float, float], None] | None = None
) -> list[dict[str, float]]:
    """Train, save to ``out``; returns the loss log (every 10 steps)."""
    torch.manual_seed(spec.seed)
    tokenizer = tiny_tokenizer(seed=spec.seed)
    config = hf_config(spec, len(tokenizer), tokenizer.eos_token_id)
    model = new_model(config, spec.seed, spec.aid_init_std)  # no aids: unused
    log: list[dict[str, float]] = []
    t0 = time.perf_counter()
    recipe = Recipe(steps=spec.steps, lr=spec.lr)
    for step, loss in enumerate(train(model, Curriculum(spec, tokenizer), recipe, on_step)):
        if step % 10 == 0 or step == spec.steps - 1:
            log.append({"step": step, "loss": round(loss, 4),
                        "seconds": round(time.perf_counter() - t0, 1)})
    save(model, config, tokenizer, spec, out, log)
    return log
