"""An in-process vLLM engine on this CPU, set up the way the tests and the bench run it.

The settings are the ones that make a CPU build of vLLM deterministic and small: one
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``),
eager mode, no prefix caching and no async scheduling (the logits processor then sees
each sampled token before the next step's metadata is built), a 1 GiB KV cache, and no
network. ``block_size`` must match our engine's for DA outputs to match: both round
scopes to whole blocks, and the CPU kernel takes multiples of 32.

``python -m declattn.vllm.offline SPEC.json OUT.json`` runs one batch described in a
JSON file and writes the outputs: the tests use it to run a batch in a fresh process
with the plugin switched off (``VLLM_PLUGINS=""``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFFLINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    # vLLM's CPU worker otherwise pins one thread per core it finds, busy or not
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
DEFAULT_BLOCK_SIZE = 32


def parse_llm_args(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as ``vllm.LLM`` keyword arguments; a VALUE that parses as
    JSON is taken as such (``false``, ``2``, ``{"cudagraph_mode": "PIECEWISE"}``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--vllm-arg {pair!r}: use KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def offline_env() -> None:
    """Set the environment above, keeping any value the caller already set."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class ServedModel:
    """A model as vLLM serves it: a Hugging Face directory, and the tokenizer our
    protocol code renders prompts with (the one our engine uses for that directory)."""

    directory: Path
    tokenizer: Any


def served_model(model: str | Path) -> ServedModel:
    """A Hugging Face directory is served as it is; a shipped model's name or a GGUF
    file goes through our loader once, which converts it into the user's cache (the
    weights it loads on the CPU are dropped: vLLM loads its own copy)."""
    path = Path(model).expanduser()
    if path.is_dir():
        from declattn.engine.hf_tokenizer import directory_tokenizer

        return ServedModel(path.resolve(), directory_tokenizer(path))
    import torch

    from declattn.engine.loader import load_model
    from declattn.engine.registry import resolve_model

    loaded = load_model(resolve_model(str(model)), dtype=torch.float32, device="cpu")
    assert loaded.weights_dir is not None
    return ServedModel(loaded.weights_dir, loaded.tokenizer)


def make_llm(
    model_dir: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = 4096,
    dtype: str = "float32",
    **kwargs: Any,
) -> Any:
    """``vllm.LLM`` over a Hugging Face directory (e.g. ``LoadedModel.weights_dir``)."""
    offline_env()
    from vllm import LLM

    settings: dict[str, Any] = {
        "dtype": dtype,
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "block_size": block_size,
        "max_model_len": max_model_len,
        "async_scheduling": False,
        "enable_prefix_caching": False,
        "max_num_seqs": 8,
        "seed": 0,
    }
    settings.update(kwargs)
    return LLM(model=str(model_dir), **settings)


def output_record(request_output: Any) -> dict[str, Any]:
    """One request's result as plain data: token ids, text, and each token's logprob."""
    out = request_output.outputs[0]
    logprobs = None
    if out.logprobs is not None:
        logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return {
        "token_ids": [int(t) for t in out.token_ids],
        "text": out.text,
        "finish_reason": out.finish_reason,
        "logprobs": logprobs,
    }


def run_spec(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``spec = {"model": dir, "llm": {...}, "requests": [{"prompt_token_ids": [...],
    "params": {SamplingParams fields}}]}`` as one ``generate`` call. A DA request with a
    ``da_label`` gets ``"da"``: the plugin's report and read log for it (when it ran)."""
    from vllm import SamplingParams

    llm = make_llm(spec["model"], **spec.get("llm", {}))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in spec["requests"]]
    params = [SamplingParams(**r["params"]) for r in spec["requests"]]
    records = [output_record(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    labels = [(p.extra_args or {}).get("da_label") for p in params]
    wanted = [str(x) for x in labels if x is not None]
    logs = llm.collective_rpc(worker_logs, args=(wanted,))[0] if wanted else {}
    for record, label in zip(records, labels, strict=True):
        if label is not None and str(label) in logs:
            record["da"] = logs[str(label)]
    return records


def worker_logs(worker: Any, labels: list[str]) -> dict[str, dict[str, Any]]:
    """Run in a worker (``LLM.collective_rpc``): each labelled DA request's report and
    read log, as plain data (it crosses a process boundary under tensor parallelism)."""
    from declattn.vllm import link

    host = link.lookup(worker.vllm_config)
    if host is None:
        return {}
    bounded = any(g.verdict.by_design for g in host.state.groups.values())
    out = {}
    for label in labels:
        try:
            report = host.state.report(label)
        except KeyError:
            continue
        out[label] = {"report": report.to_dict(), "bounded": bounded,
                      "reads": [r.to_dict() | {"bytes": r.bytes_read} for r in report.reads]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m declattn.vllm.offline SPEC.json OUT.json", file=sys.stderr)
        return 2
    offline_env()
    spec = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(run_spec(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
