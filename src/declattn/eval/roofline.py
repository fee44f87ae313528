"""The roofline cost model: turn attended tokens into decode time on given hardware.

As the DA paper projects it, one decode step costs its dense FLOPs at a fraction (MFU)
of peak compute plus the KV bytes it reads at a fraction (MBU) of peak bandwidth:

    T_step = F_dense / (peak * MFU) + B_kv / (BW * MBU)

``F_dense`` is the per-token FLOPs of every weight matmul (q/k/v/o projections, the
gated MLP, the vocabulary head): two per multiply-add. ``B_kv`` is what the step's
attention reads: on global layers, the attended tokens times K and V of one token; on
sliding-window layers, the window (or the sequence, if shorter) whatever the mode, since
DA does not narrow a window. Weight bytes are left out as the paper leaves them out
(batched serving amortises them); ``include_weights`` adds them to the memory term for
single-stream decode, where they dominate.

The architecture comes from a Hugging Face ``config.json``. Anything a projection needs
and the config does not say is an error, never a default: a hybrid (sliding-window)
config must say which layers slide and how far, and a config must name its dtype
unless one is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from declattn.eval.accelerators import Accelerator

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
}
_GATED_MLP = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text"}


class RooflineConfigError(ValueError):
    """The config lacks (or contradicts) something the cost model needs."""


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of one architecture."""

    model_type: str
    n_layers: int
    global_layers: int
    sliding_layers: int
    sliding_window: int | None
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    weight_bytes_per_param: float
    kv_bytes_per_value: float

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """K and V of one token in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token occupies, all layers."""
        return self.n_layers * self.kv_bytes_per_token_layer

    @property
    def params(self) -> int:
        """Weights of the matmuls (embedding counted once, as the vocabulary head)."""
        h, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate
        return self.n_layers * per_layer + h * self.vocab

    @property
    def dense_flops_per_token(self) -> float:
        return 2.0 * self.params

    def attention_flops(self, global_attended: float, length: int) -> float:
        """Score and value FLOPs of one step (small next to the dense ones; reported only)."""
        per_pos = 4 * self.n_heads * self.head_dim
        return per_pos * (
            self.global_layers * global_attended + self.sliding_layers * self._window(length)
        )

    def _window(self, length: int) -> int:
        return min(self.sliding_window or 0, length)

    def kv_bytes_read(self, global_attended: float, length: int) -> float:
        """KV bytes one decode step reads: attended tokens on global layers, the window on
        sliding ones."""
        per = self.kv_bytes_per_token_layer
        return per * (
            self.global_layers * global_attended + self.sliding_layers * self._window(length)
        )

    def step_seconds(
        self,
        acc: Accelerator,
        global_attended: float,
        length: int,
        *,
        mfu: float,
        mbu: float,
        include_weights: bool = False,
    ) -> float:
        memory = self.kv_bytes_read(global_attended, length)
        if include_weights:
            memory += self.params * self.weight_bytes_per_param
        return self.dense_flops_per_token / (acc.peak_flops * mfu) + memory / (acc.bandwidth * mbu)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model under ``text_config``."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        inner = dict(config["text_config"])
        for k in ("torch_dtype", "dtype"):
            inner.setdefault(k, config.get(k))
        return inner
    return config


def _req(c: dict[str, Any], key: str) -> int:
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise RooflineConfigError(f"config.json: {key} is missing or not a positive integer")
    return v


def _layer_kinds(c: dict[str, Any], n_layers: int, model_type: str) -> list[bool]:
    """``True`` for each sliding-window layer; raises where the config does not say."""
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise RooflineConfigError(
                f"config.json: layer_types lists {len(types)} layers, num_hidden_layers "
                f"is {n_layers}"
            )
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise RooflineConfigError(f"config.json: unsupported layer types {unknown}")
        kinds = [t == "sliding_attention" for t in types]
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern"))
        if not isinstance(pattern, int) or pattern < 1:
            raise RooflineConfigError(
                "config.json: a Gemma 3 config needs layer_types or sliding_window_pattern "
                "to say which layers slide"
            )
        kinds = [(i + 1) % pattern != 0 for i in range(n_layers)]
    elif model_type in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        start = c.get("max_window_layers")
        if not isinstance(start, int):
            raise RooflineConfigError(
                "config.json: use_sliding_window is set but max_window_layers is missing"
            )
        kinds = [i >= start for i in range(n_layers)]
    elif model_type in ("qwen2", "qwen3") or window is None:
        kinds = [False] * n_layers
    elif model_type == "mistral":
        kinds = [True] * n_layers
    else:
        raise RooflineConfigError(
            f"config.json: sliding_window={window} but nothing says which layers slide "
            "(no layer_types)"
        )
    if any(kinds) and (not isinstance(window, int) or window <= 0):
        raise RooflineConfigError(
            "config.json: sliding-window layers are declared but sliding_window is missing"
        )
    return kinds


def model_cost(
    config: dict[str, Any], *, dtype: str | None = None, kv_dtype: str | None = None
) -> ModelCost:
    """Per-token costs from a Hugging Face ``config.json`` dict.

    ``dtype`` (weights) defaults to the config's ``torch_dtype``/``dtype``; ``kv_dtype``
    to the weights' dtype.
    """
    c = _text_config(config)
    model_type = str(c.get("model_type") or "")
    if model_type not in _GATED_MLP:
        raise RooflineConfigError(
            f"config.json: model_type {model_type!r} is not one whose layer shapes this "
            f"model knows ({', '.join(sorted(_GATED_MLP))})"
        )
    for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
        if (c.get(moe) or 0) > 1:
            raise RooflineConfigError(f"config.json: mixture-of-experts ({moe}) is not modelled")
    n_layers = _req(c, "num_hidden_layers")
    hidden = _req(c, "hidden_size")
    heads = _req(c, "num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    dt = dtype or c.get("torch_dtype") or c.get("dtype")
    if dt is None:
        raise RooflineConfigError("config.json names no dtype (torch_dtype): give one")
    if dt not in DTYPE_BYTES:
        raise RooflineConfigError(f"unknown dtype {dt!r}; known: {', '.join(DTYPE_BYTES)}")
    kv_dt = kv_dtype or dt
    if kv_dt not in DTYPE_BYTES:
        raise RooflineConfigError(f"unknown KV dtype {kv_dt!r}")
    kinds = _layer_kinds(c, n_layers, model_type)
    return ModelCost(
        model_type=model_type,
        n_layers=n_layers,
        global_layers=kinds.count(False),
        sliding_layers=kinds.count(True),
        sliding_window=c.get("sliding_window") if any(kinds) else None,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        intermediate=_req(c, "intermediate_size"),
        vocab=_req(c, "vocab_size"),
        weight_bytes_per_param=DTYPE_BYTES[dt],
        kv_bytes_per_value=DTYPE_BYTES[kv_dt],
    )


@dataclass(frozen=True)
class Projection:
    """Projected decode time of one response (sum over its steps) on one accelerator."""

    accelerator: str
    seconds: float
    compute_seconds: float
    memory_seconds: float


def project_steps(
    cost: ModelCost,
    acc: Accelerator,
    steps: Sequence[tuple[float, int]],
    *,
    mfu: float,
    mbu: float,
    include_weights: bool = False,
) -> Projection:
    """``steps``: ``(global attended tokens, sequence length)`` per decode step."""
    if not 0 < mfu <= 1 or not 0 < mbu <= 1:
        raise ValueError("MFU and MBU are fractions in (0, 1]")
    compute = len(steps) * cost.dense_flops_per_token / (acc.peak_flops * mfu)
    memory_bytes = sum(cost.kv_bytes_read(a, n) for a, n in steps)
    if include_weights:
        memory_bytes += len(steps) * cost.params * cost.weight_bytes_per_param
    memory = memory_bytes / (acc.bandwidth * mbu)
    return Projection(acc.name, compute + memory, compute, memory)


def row_steps(row: dict[str, Any], reads: str = "logical") -> list[tuple[float, int]]:
    """A results row's decode steps as ``(attended, length)`` for ``project_steps``."""
    from declattn.eval.rows import steps_of

    if reads not in ("logical", "physical"):
        raise ValueError("reads must be logical or physical")
    return [(float(s[reads]), int(s["length"])) for s in steps_of(row)]


def config_for_model(name_or_path: str) -> dict[str, Any]:
    """The ``config.json`` of a shipped model name, a model directory, or a GGUF file
    (read from the converted copy the loader keeps; run the model once to create it)."""
    import json
    from pathlib import Path

    from declattn.engine.loader import conversion_dir
    from declattn.engine.registry import resolve_model

    path = resolve_model(name_or_path)
    if path.is_dir():
        candidate = path / "config.json"
    else:
        candidate = conversion_dir(path) / "config.json"
    if not Path(candidate).is_file():
        raise RooflineConfigError(
            f"no config.json for {name_or_path} at {candidate}; pass --config, or run the "
            "model once so the loader converts it"
        )
    return json.loads(Path(candidate).read_text())


def rows_kv_dtype(rows: Sequence[dict[str, Any]], cost: ModelCost) -> str | None:
    """The KV dtype a run used: recorded in its rows, or else read off the bytes its
    decode steps counted (global-layer bytes over positions read); ``None`` if neither."""
    from declattn.eval.rows import steps_of

    for row in rows:
        if row.get("kv_dtype"):
            return str(row["kv_dtype"])
    per_value = 2 * cost.n_kv_heads * cost.head_dim * cost.global_layers
    for row in rows:
        for st in steps_of(row):
            if st.get("global_bytes") and st["logical"]:
                size = st["global_bytes"] / (st["logical"] * per_value)
                return {4.0: "float32", 2.0: "bfloat16", 1.0: "fp8"}.get(round(size, 3))
    return None
