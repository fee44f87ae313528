"""From a validated request body to what the scheduler runs: prompt ids, sampling, controller.

Everything that can be refused is refused here, before a request reaches the queue:
an unknown content type, bad DA options, a context the segmenter cannot cut, a prompt
plus ``max_tokens`` over the model's positions or over the whole KV pool. The work
(segmenting, rendering, tokenising) runs off the event loop, in a worker thread.

DA prompts: the last user message is the question and the extension's context (or
documents) is cut into magic chunks; system and earlier messages are not part of a DA
prompt, because the DA prompt has its own fixed system turn and layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from declattn.api.session import DASession, PlainSession, Session
from declattn.da.options import DAOptions
from declattn.engine.sampler import SamplingParams
from declattn.protocol.segment import SegmentError
from declattn.protocol.template import NoChatTemplateError
from declattn.server.errors import ECHO_MESSAGE_CHARS, APIError, bad_request, echo
from declattn.server.schemas import ChatCompletionRequest, CompletionRequest, DARequest
from declattn.server.token_bound import TokenBound

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default when a request names none; send ``temperature: 0`` for greedy."""
GREEDY_BELOW = 1e-4
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``."""


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    max_positions: int
    pool_blocks: int
    block_size: int
    max_tokens_cap: int | None = None
    default_max_tokens: int = 512
    token_bound: TokenBound | None = None
    """How few tokens a text can be (``token_bound``); ``None``: no bound."""
    request_timeout_s: float | None = None
    """The server's cap on a request's time (``--request-timeout``); ``None``: none."""

    def timeout(self, requested: float | None) -> float | None:
        """A request's time limit: its own, capped by the server's."""
        limits = [t for t in (requested, self.request_timeout_s) if t is not None]
        return min(limits) if limits else None

    @property
    def prompt_cap(self) -> int:
        """The most prompt tokens a request can have: one position is left to generate."""
        return min(self.max_positions, self.pool_blocks * self.block_size) - 1


@dataclass
class Prepared:
    """A request ready to queue: the controller is the session the engine will drive."""

    prompt_ids: list[int]
    params: SamplingParams
    session: Session
    is_da: bool
    strip_tags: bool = False
    timeout_s: float | None = None
    """Seconds the request may take from submission to its last token (``None``: no
    limit); past it, it ends with what it wrote (``finish_reason`` ``length``, the
    engine's reason ``timeout`` in its usage), or, still queued, with a 408."""

    @property
    def blocks_needed(self) -> int:
        """Blocks free at admission: the prompt's and one more (its first decode step).
        Later blocks are taken as the response grows; a pool that runs out preempts
        (``PagedEngine.step``)."""
        return len(self.prompt_ids) // self.session.block_size + 1


# -- message text --------------------------------------------------------------------
def valid_text(text: str, param: str) -> str:
    """``text`` if it is encodable Unicode; JSON can carry lone surrogates, which the
    tokenizers refuse with errors of several types."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param}: the text is not valid Unicode ({e.reason} at {e.start})",
            param=param,
            code="invalid_unicode",
        ) from e
    return text


def valid_json(value: Any, param: str) -> Any:
    """``value`` (parsed JSON: tool calls, tool definitions) if every string in it, keys
    included, is encodable Unicode; else a 400 naming the first bad one's place."""
    if isinstance(value, str):
        return valid_text(value, param)
    if isinstance(value, dict):
        for key, item in value.items():
            valid_text(str(key), f"{param} (a key)")
            valid_json(item, f"{param}.{echo(key)}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            valid_json(item, f"{param}[{i}]")
    return value


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return valid_text(content, f"{where}.content")
    pieces = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"{where}.content[{i}]: content type '{echo(part.type)}' is not supported "
                "(only 'text')",
                param=f"{where}.content[{i}].type",
            )
        if part.text is None:
            raise bad_request(
                f"{where}.content[{i}]: a text part needs 'text'", param=f"{where}.content[{i}]"
            )
        pieces.append(valid_text(part.text, f"{where}.content[{i}].text"))
    return "".join(pieces)


def _messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    return [
        {"role": m.role, "content": _content_text(m.content, f"messages[{i}]")}
        for i, m in enumerate(req.messages)
    ]


# -- sampling ------------------------------------------------------------------------
def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return tuple(valid_text(s, "stop") for s in stops)


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise bad_request(f"n={n} is not supported: this server returns one choice (n=1)",
                          param="n", code="unsupported_value")


def _requested_max(requested: int | None, default: int, limits: Limits) -> tuple[int, bool]:
    """``(max_tokens, explicit)``, clipped to the server's cap."""
    value = requested if requested is not None else default
    if limits.max_tokens_cap is not None:
        value = min(value, limits.max_tokens_cap)
    return value, requested is not None


def _fit_length(prompt_len: int, max_tokens: int, explicit: bool, limits: Limits) -> int:
    """The final ``max_tokens``: a default shrinks to the room left, an explicit one must fit."""
    room = limits.max_positions - prompt_len
    if not explicit and max_tokens > room >= 1:
        max_tokens = room
    if prompt_len + max_tokens > limits.max_positions:
        raise bad_request(
            f"This model's maximum context length is {limits.max_positions} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "of the completion.",
            param="messages",
            code="context_length_exceeded",
        )
    blocks = -(-(prompt_len + max_tokens) // limits.block_size)
    if blocks > limits.pool_blocks:
        raise bad_request(
            f"the request needs {prompt_len + max_tokens} tokens of KV cache ({prompt_len} in "
            f"the prompt, {max_tokens} in the completion), {blocks} blocks, but this server's "
            f"KV pool holds only {limits.pool_blocks} blocks "
            f"({limits.pool_blocks * limits.block_size} tokens)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def check_chars(text: str, limits: Limits, param: str) -> None:
    """Refuse a prompt before tokenising it where even the fewest tokens ``text`` can be
    are over the cap; the exact count (``_fit_length``) decides the rest."""
    bound = limits.token_bound
    least = bound.fewest_tokens(text) if bound else 0
    if bound and least > limits.prompt_cap:
        raise bad_request(
            f"This model's maximum context length is {limits.max_positions} tokens "
            f"(this server's KV pool: {limits.pool_blocks * limits.block_size}). However, "
            f"the prompt holds {len(text)} characters, at least {least} tokens (this "
            f"tokenizer writes at most {bound.chars_per_token} characters a token). Please "
            "reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def _nonspace(text: str) -> str:
    """``text`` without its whitespace: what a template that trims text still keeps."""
    return "".join(text.split())


def _temperature(req: Any) -> float:
    """Near-zero ``temperature`` or ``top_p`` sample greedily, which is what they tend to.

    Taken literally they overflow: logits / T turn infinite, and a ``top_p`` below
    float32's resolution masks every token; the non-finite probabilities would make the
    sampler raise inside the engine step and fail every request in that step.
    """
    value = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    if value < GREEDY_BELOW or (req.top_p is not None and req.top_p < GREEDY_BELOW):
        return 0.0
    return value


def _params(req: Any, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=_temperature(req),
            top_p=req.top_p if req.top_p is not None and req.top_p >= GREEDY_BELOW else 1.0,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=_stop(req.stop),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:
        raise bad_request(str(e)) from e


# -- DA ------------------------------------------------------------------------------
def da_options(da: DARequest, defaults: DAOptions | None = None) -> DAOptions:
    """The extension's options over the model's own DA defaults (its ``declattn.json``:
    chunk size, sink, prompt style and instruction of a model trained to declare);
    inconsistent ones are a 400."""
    base = defaults or DAOptions()
    target = da.chunk_tokens
    cap = da.chunk_cap
    if target is None and cap is None:
        target, cap = base.target, base.cap
    elif target is None:
        assert cap is not None
        target = min(base.target, cap)
    elif cap is None:  # keep the model's own cap/target ratio (1.25 by default)
        cap = max(target, math.ceil(target * base.cap / base.target))
    if cap < target:
        raise bad_request(
            f"declarative_attention.chunk_cap ({cap}) must be at least chunk_tokens ({target})",
            param="declarative_attention.chunk_cap",
            code="invalid_da_options",
        )
    options = replace(base, target=target, cap=cap, line_start=da.line_start, masking=da.masking)
    if da.constrain is not None:
        options = replace(options, constrain=da.constrain)
    if da.min_context is not None:
        options = replace(options, min_context=da.min_context)
    if da.focus is not None:
        options = replace(options, focus=da.focus)
    if da.index is not None:
        options = replace(options, index=da.index)
    return options


def da_context(da: DARequest) -> str:
    if (da.context is None) == (da.documents is None):
        raise bad_request(
            "declarative_attention needs exactly one of 'context' or 'documents'",
            param="declarative_attention",
            code="invalid_da_options",
        )
    if da.documents is not None:
        if not da.documents:
            raise bad_request("declarative_attention.documents is empty",
                              param="declarative_attention.documents",
                              code="invalid_da_options")
        docs = [valid_text(d, f"declarative_attention.documents[{i}]")
                for i, d in enumerate(da.documents)]
        return "\n\n".join(docs)
    assert da.context is not None
    return valid_text(da.context, "declarative_attention.context")


def _template_ids(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    limits: Limits,
) -> list[int]:
    """A plain chat through the model's own template (tools in it), tokenised."""
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions with a raw "
                          "prompt", param="messages")
    try:
        text = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # the template's own checks (role order, ...) fail as jinja errors
        raise bad_request("the chat template cannot render these messages: "
                          f"{echo(e, ECHO_MESSAGE_CHARS)}", param="messages") from e
    check_chars(text, limits, "messages")
    return list(tok.encode(text, add_special_tokens=False))


def _question(messages: list[dict[str, str]]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise bad_request("a DA request needs a user message (the last one is the question)",
                          param="messages")
    if not users[-1].strip():
        raise bad_request("the last user message (the DA question) is empty", param="messages")
    return users[-1]


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them, tool calls kept."""
    out = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": m.role, "content": _content_text(m.content, f"messages[{i}]")}
        extra = m.model_extra or {}
        for key in ("tool_calls", "tool_call_id"):
            if extra.get(key) is not None:
                d[key] = valid_json(extra[key], f"messages[{i}].{key}")
        if m.name is not None:
            d["name"] = valid_text(m.name, f"messages[{i}].name")
        out.append(d)
    return out


def _tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tool definitions, their text checked (the template renders it)."""
    return None if req.tools is None else valid_json(req.tools, "tools")


def _messages_session(
    engine: Any, req: ChatCompletionRequest, options: DAOptions, max_tokens: int,
    limits: Limits,
) -> Session:
    """The session of ``chunks: "messages"``: the conversation is the context."""
    from declattn.api import RunVanilla

    da = req.declarative_attention
    assert da is not None
    if da.context is not None or da.documents is not None:
        raise bad_request(
            "declarative_attention.chunks='messages' takes the conversation as its context: "
            "drop 'context' and 'documents'",
            param="declarative_attention.chunks", code="invalid_da_options",
        )
    messages, tools = _chat_messages(req), _tools(req)
    check_chars("".join(_nonspace(m["content"]) for m in messages), limits, "messages")
    try:
        return engine.messages_session(
            messages, tools=tools, options=options, max_tokens=max_tokens
        )
    except RunVanilla as e:
        ids = _template_ids(engine.tokenizer, messages, tools, limits)
        sess = PlainSession(ids, limits.block_size)
        sess.note = str(e)
        return sess


def _prepare_da(engine: Any, req: ChatCompletionRequest, limits: Limits) -> Prepared:
    da = req.declarative_attention
    assert da is not None
    options = da_options(da, engine.da_defaults)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens, explicit = _requested_max(requested, limits.default_max_tokens, limits)
    try:
        if da.chunks == "messages":
            sess = _messages_session(engine, req, options, max_tokens, limits)
        else:
            context = da_context(da)
            # every character of the context is in the prompt, whitespace perhaps trimmed
            check_chars(_nonspace(context), limits, "declarative_attention.context")
            question = _question(_messages(req))
            sess = engine.session(
                context, question, da=True, options=options, max_tokens=max_tokens
            )
    except APIError:
        raise
    except SegmentError as e:
        raise bad_request(f"declarative_attention: {e}", param="declarative_attention.context",
                          code="invalid_da_options") from e
    except NoChatTemplateError as e:
        raise bad_request(str(e), param="declarative_attention") from e
    except ValueError as e:
        raise bad_request(f"declarative_attention: {e}", param="declarative_attention",
                          code="invalid_da_options") from e
    final = _fit_length(len(sess.prompt_ids), max_tokens, explicit, limits)
    if final != max_tokens and isinstance(sess, DASession) and sess.runaway is not None:
        sess.runaway.max_tokens = final  # the guard's budget is the response's budget
    strip = da.return_tags == "strip" and isinstance(sess, DASession)
    return Prepared(sess.prompt_ids, _params(req, final), sess, True, strip,
                    limits.timeout(req.timeout))


# -- entry points --------------------------------------------------------------------
def prepare_chat(engine: Any, req: ChatCompletionRequest, limits: Limits) -> Prepared:
    """A chat request: DA when the extension is present, else the model's chat template."""
    _check_n(req.n)
    if req.declarative_attention is not None:
        return _prepare_da(engine, req, limits)
    ids = _template_ids(engine.tokenizer, _chat_messages(req), _tools(req), limits)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens, explicit = _requested_max(requested, limits.default_max_tokens, limits)
    final = _fit_length(len(ids), max_tokens, explicit, limits)
    return Prepared(ids, _params(req, final), PlainSession(ids, limits.block_size), False,
                    timeout_s=limits.timeout(req.timeout))


def prepare_completion(engine: Any, req: CompletionRequest, limits: Limits) -> Prepared:
    """A raw-prompt completion: the prompt is tokenised as it is, no template."""
    _check_n(req.n)
    if req.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported_value")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request("prompt must be one string (a list must hold exactly one)",
                              param="prompt", code="unsupported_value")
        prompt = prompt[0]
    valid_text(prompt, "prompt")
    check_chars(prompt, limits, "prompt")
    ids = list(engine.tokenizer.encode(prompt, add_special_tokens=True))
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    max_tokens, explicit = _requested_max(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, limits)
    final = _fit_length(len(ids), max_tokens, explicit, limits)
    return Prepared(ids, _params(req, final), PlainSession(ids, limits.block_size), False,
                    timeout_s=limits.timeout(req.timeout))


__all__ = ["APIError", "Limits", "Prepared", "prepare_chat", "prepare_completion"]
