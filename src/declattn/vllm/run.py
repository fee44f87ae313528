"""``declattn run --backend vllm``: the same request as ``declattn run``, served by vLLM.

vLLM runs in this process (the offline settings of ``offline.py``), with the plugin; the
prompt is built by ``build_request`` from the model's own tokenizer, so it is the prompt
our engine would run. What the attention read comes from the patched builder's log.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from declattn.da.options import DAOptions, model_da_defaults
from declattn.protocol.answer import answer_text
from declattn.vllm.offline import (
    DEFAULT_BLOCK_SIZE,
    ServedModel,
    make_llm,
    offline_env,
    served_model,
)
from declattn.vllm.request import build_request
from declattn.vllm.tracker import ReadRecord

ARMS = ("da", "da-nm", "vanilla")


@dataclass
class VllmAnswer:
    arm: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    reads: list[ReadRecord] = field(default_factory=list)
    block_size: int = DEFAULT_BLOCK_SIZE
    report: dict[str, Any] | None = None  # the plugin's per-request report (DA arms)

    @property
    def answer(self) -> str | None:
        return answer_text(self.text)

    def blocks(self) -> tuple[int, int]:
        """Blocks handed to the kernel, and what full reads would have been, summed."""
        read = sum(len(r.physical) for r in self.reads)
        full = sum(-(-r.length // self.block_size) for r in self.reads)
        return read, full


def run_arms(
    model: str | ServedModel,
    context: str,
    question: str,
    arms: tuple[str, ...] = ("da",),
    *,
    options: DAOptions | None = None,
    max_tokens: int = 512,
    dtype: str = "float32",
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
) -> list[VllmAnswer]:
    """Answer with each arm, all in one vLLM batch. ``options``: the model's own DA
    defaults when None (its ``declattn.json``); the constraint of its focus form on unless
    ``options.constrain`` says otherwise."""
    offline_env()
    from declattn.protocol.prompt import render_plain
    from declattn.vllm import link

    served = model if isinstance(model, ServedModel) else served_model(model)
    tok = served.tokenizer
    base = options or model_da_defaults(served.directory)
    if base.constrain is None:
        base = dataclasses.replace(base, constrain=True)
    prompts, params, labels = [], [], []
    longest = 0
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, not {arm!r}")
        if arm == "vanilla":
            ids = render_plain(tok, context, question)
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        else:
            opts = dataclasses.replace(base, masking=arm == "da")
            req = build_request(context, question, tok, opts, label=f"cli-{arm}")
            ids = req.prompt_token_ids
            sp = req.sampling_params(max_tokens=max_tokens)
        prompts.append({"prompt_token_ids": ids})
        params.append(sp)
        labels.append(f"cli-{arm}")
        longest = max(longest, len(ids))
    limit = max_model_len or max(4096, longest + max_tokens + block_size)
    llm = make_llm(served.directory, block_size=block_size, max_model_len=limit, dtype=dtype)
    outs = llm.generate(prompts, params, use_tqdm=False)
    procs = [p for p in link.processors() if p.enabled]
    answers = []
    for arm, label, ids, out in zip(arms, labels, prompts, outs, strict=True):
        o = out.outputs[0]
        reads: list[ReadRecord] = []
        report = None
        if arm != "vanilla" and procs:
            reads = procs[-1].reads(label)
            report = procs[-1].report(label).to_dict()
        answers.append(
            VllmAnswer(arm, o.text, list(o.token_ids), o.finish_reason,
                       len(ids["prompt_token_ids"]), reads, block_size, report)
        )
    return answers


def summary(a: VllmAnswer) -> dict[str, Any]:
    read, full = a.blocks()
    return {
        "arm": a.arm,
        "backend": "vllm",
        "text": a.text,
        "answer": a.answer,
        "finish_reason": a.finish_reason,
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": len(a.token_ids),
        "blocks_read": read,
        "blocks_full": full,
        "reads": [r.to_dict() for r in a.reads],
        "report": a.report,
    }
