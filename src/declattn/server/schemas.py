"""Request bodies of the OpenAI-compatible API, plus the ``declarative_attention`` extension.

The models follow OpenAI's field names so the official clients work unchanged. Fields
OpenAI defines that this server does not implement (penalties, logprobs, tools, ...)
are accepted and ignored, as most compatible servers do; ``n`` must be 1. The bounds
written here also go into ``/openapi.json``, which is what a fuzzer reads, so they
state what a valid request is rather than what happens to be handled.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_STOP_STRINGS = 4

StopList = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
"""Up to four stop strings. The bound is on the list: on ``str | list[str]`` it would also
bound a single string's characters (``"stop": "\\n\\nUser:"`` refused)."""


class DARequest(BaseModel):
    """Run the request with Declarative Attention over ``context`` (or ``documents``).

    The last user message is the question; earlier messages are not part of a DA prompt.
    """

    model_config = ConfigDict(extra="forbid")

    context: str | None = Field(None, description="the long input, cut into magic chunks")
    documents: list[str] | None = Field(
        None, description="several inputs, joined with blank lines into the context"
    )
    chunk_tokens: int | None = Field(
        None, ge=1, description="target tokens per magic chunk (default 2048)"
    )
    chunk_cap: int | None = Field(
        None, ge=1,
        description="hard cap of tokens per chunk (default: chunk_tokens x the model's "
        "cap/target ratio, 1.25 unless its declattn.json says otherwise)",
    )
    constrain: bool | None = Field(
        None,
        description="mask logits inside focus tags so only valid ids can be written "
        "(default: on for models under 1B parameters)",
    )
    line_start: bool = Field(False, description="opening tags count only at line start")
    masking: bool = Field(True, description="false runs the DA prompt with full reads (DA-nm)")
    chunks: Literal["context", "messages"] = Field(
        "context",
        description="'context': the magic chunks are cut from context/documents; "
        "'messages': the conversation itself is the context, every earlier message (tool "
        "results, documents pasted in a turn, earlier turns) a magic chunk",
    )
    focus: Literal["ids", "find", "both"] | None = Field(
        None,
        description="the focus form the instruction teaches: 'ids' (magic_chunks=\"K\"), "
        "'find' (<focus find=\"WORDS\">, looked up in the chunks by the engine) or 'both' "
        "(the find instruction, both constrained); the model's own by default",
    )
    index: int | None = Field(
        None, ge=0, le=4096,
        description="with focus 'find'/'both': a token budget for an in-context index of "
        "the chunks in the instruction (0: none)",
    )
    min_context: int | None = Field(
        None, ge=0,
        description="contexts shorter than this many tokens run vanilla (the usage says so); "
        "unset, the gate weighs the whole DA reply against the plain reply (docs/protocol.md, "
        "'The gate'); 0 never falls back",
    )
    return_tags: Literal["content", "strip"] = Field(
        "content",
        description="'content' leaves tags in the text; 'strip' removes them and returns "
        "them in the message's 'declarations'",
    )


class TextPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Sampling(BaseModel):
    """Sampling fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | StopList | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int | None = Field(None, ge=1, description="only 1 is supported")
    ignore_eos: bool = Field(
        False, description="write past the end-of-text token, up to max_tokens (vLLM's and "
        "llama-server's extension: a benchmark's fixed reply length)",
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(
        None, gt=0, le=86400,
        description="seconds the request may take, queue included; past it the response "
        "ends with what it wrote (finish_reason 'length', usage.engine_finish_reason "
        "'timeout'); the server's --request-timeout caps it",
    )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = Field(
        None, description="tool definitions, rendered by the chat template"
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    declarative_attention: DARequest | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(..., description="a raw prompt (a list must hold one)")
    echo: bool | None = False
