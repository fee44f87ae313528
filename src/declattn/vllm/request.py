"""Build a DA request for vLLM from a context, a question and the served tokenizer.

It runs the same segmenter, renderer and layout code as our own engine (the same calls
``DASession`` makes), so a prompt sent to vLLM is token for token the prompt our engine
would prefill. The prompt goes to vLLM as token ids, never as text, so vLLM's own
tokenizer cannot shift a span by a token.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from declattn.api.session import DASession
from declattn.da.options import DAOptions
from declattn.protocol.layout import Layout
from declattn.protocol.prompt import RenderedPrompt, render_prompt
from declattn.protocol.segment import Chunk, segment, token_counter
from declattn.vllm.xargs import DASpec

ANSWER_CLOSE = "</answer>"
"""Our engine ends a DA response at the closing answer tag; vLLM does it as a stop string
kept in the output (``include_stop_str_in_output``)."""


@dataclass(frozen=True)
class VllmDARequest:
    """A DA request ready for ``LLM.generate`` or the OpenAI-compatible server."""

    rendered: RenderedPrompt
    chunks: tuple[Chunk, ...]
    spec: DASpec
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return self.rendered.layout

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.rendered.token_ids)

    @property
    def extra_args(self) -> dict[str, Any]:
        """``SamplingParams.extra_args`` (or ``vllm_xargs`` over HTTP)."""
        return {**self.spec.to_args(), **self.extra}

    def prompt(self) -> dict[str, Any]:
        """A ``TokensPrompt`` for ``LLM.generate``."""
        return {"prompt_token_ids": self.prompt_token_ids}

    def sampling_params(self, **kwargs: Any) -> Any:
        """``vllm.SamplingParams`` carrying the DA args; greedy unless told otherwise.

        The response stops after ``</answer>`` as our engine's does; pass ``stop=[]`` to
        let it run to ``max_tokens``.
        """
        from vllm import SamplingParams

        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("stop", [ANSWER_CLOSE])
        kwargs.setdefault("include_stop_str_in_output", True)
        extra = dict(kwargs.pop("extra_args", None) or {})
        return SamplingParams(extra_args={**self.extra_args, **extra}, **kwargs)

    def http_body(self, model: str, **fields: Any) -> dict[str, Any]:
        """A ``/v1/completions`` body: the prompt as token ids, DA in ``vllm_xargs``."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt_token_ids,
            "temperature": 0.0,
            "stop": [ANSWER_CLOSE],
            "include_stop_str_in_output": True,
            "vllm_xargs": self.extra_args,
        }
        body.update(fields)
        return body


def session_request(sess: DASession, *, label: str | None = None) -> VllmDARequest:
    """The vLLM request of a ``DASession`` already built (same prompt, same layout): the
    eval backend keeps the session to count the response as our engine counts it."""
    o = sess.options
    warn_no_jump_forward(o)
    spec = DASpec(layout=sess.layout, line_start=o.line_start, masking=o.masking,
                  constrain=bool(o.constrain), label=label, focus=o.focus,
                  scaffold_local=o.scaffold_local, require_answer=o.require_answer,
                  open_tag=o.open_tag, answer_after_find=o.answer_after_find)
    return VllmDARequest(rendered=sess.prompt, chunks=tuple(sess.chunks), spec=spec)


def build_request(
    context: str,
    question: str,
    tokenizer: Any,
    options: DAOptions | None = None,
    *,
    force: list[int] | tuple[int, ...] = (),
    label: str | None = None,
) -> VllmDARequest:
    """The DA request our engine would run for ``(context, question)``.

    ``options.constrain`` turns the constraint of ``options.focus`` on in the engine core
    (the focus-id one, the find one, or both; ``None`` counts as off here: the caller
    decides, as ``Engine.session`` does for small models); ``options.focus`` and
    ``options.index`` choose the instruction as they do for our engine.
    ``force`` makes the response start with those tokens (teacher forcing, for replays
    and tests). ``label`` names the request in the engine core's read log.
    """
    if not question.strip():
        raise ValueError("the question is empty")
    o = options or DAOptions()
    warn_no_jump_forward(o)
    chunks = segment(context, token_counter(tokenizer), o.target, o.cap)
    rendered = render_prompt(
        tokenizer, chunks, question, sink=o.sink, style=o.style,
        instruction=o.instruction_for(chunks, tokenizer),
    )
    spec = DASpec(
        layout=rendered.layout,
        line_start=o.line_start,
        masking=o.masking,
        constrain=bool(o.constrain),
        force=tuple(int(t) for t in force),
        label=label,
        focus=o.focus,
        scaffold_local=o.scaffold_local,
        require_answer=o.require_answer,
        open_tag=o.open_tag,
        answer_after_find=o.answer_after_find,
    )
    return VllmDARequest(rendered=rendered, chunks=tuple(chunks), spec=spec)


def warn_no_jump_forward(options: DAOptions) -> None:
    """vLLM's scheduler decodes one token a step: fixed tag text (``jump_forward``) is
    decoded token by token there, and a find phrase that names one chunk is not closed
    for the model (``close_find_at_one_chunk``). Say so (once per place, Python's default
    filter), never pretend: the reads are the same, the extra steps are not."""
    if options.jump_forward:
        warnings.warn(
            "jump-forward is not available through vLLM: fixed tag text is decoded one "
            "token a step there (same reads, more steps), and a find phrase is closed "
            "where the model closes it; our engine appends fixed text in one forward",
            stacklevel=3,
        )
