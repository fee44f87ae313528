"""Chunks + question -> the token ids of a DA prompt, and its layout.

The prompt goes through the model's own chat template, so the model sees the turn
format it was trained on. Two shapes exist:

- ``tools``: each magic chunk arrives as the response to a ``get_magic_chunk`` tool
  call, the way agent transcripts carry long context;
- ``inline``: for templates without tool roles, the chunks sit in one user turn under
  ``Magic Chunk N`` headers, then a short assistant acknowledgement keeps the roles
  alternating for strict templates.

Both start with a content-free system turn, so the attention sink holds no chunk text,
and end with a user turn holding the question and the DA instruction.

User text never turns into template tokens and its spans are exact: the sentinel
technique of ``template.py`` (shared with ``messages.py``, the chat-as-chunks renderer).

The question window starts at the role header of the final user turn, not at the
question text: the header is scaffold every mode should keep reading, and the span is
found by rendering the conversation without that turn, which must be a prefix of the
full render. Where a template breaks that prefix property, the window starts at the
question text itself (a few header tokens then go unattended in focus and local).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from declattn.protocol.instruction import DA_INSTRUCTION, final_turn
from declattn.protocol.layout import Layout, Span
from declattn.protocol.template import (
    assemble,
    nonce,
    render_chat,
    require_chat_template,
    special_ids,
    verify_span,
)

SYSTEM_LINE = "You are a careful assistant."
TOOL_NAME = "get_magic_chunk"
STYLES = ("auto", "tools", "inline")

TOOL_SPEC: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Return one numbered magic chunk of the document.",
        "parameters": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "The magic chunk number, from 1."}
            },
            "required": ["id"],
        },
    },
}


class ChunkLike(Protocol):
    """Anything with a 1-based chunk ``id`` and its ``text`` (e.g. ``segment.Chunk``)."""

    @property
    def id(self) -> int: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class RenderedPrompt:
    """A DA prompt ready for prefill.

    ``text`` is the prompt as text, for display and logs; ``token_ids`` is the truth
    (tokenising ``text`` again would parse special tokens in user text).
    """

    token_ids: list[int]
    layout: Layout
    text: str
    style: str

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``ids, layout = render_prompt(...)``."""
        yield self.token_ids
        yield self.layout


def render_prompt(
    tokenizer: Any,
    chunks: Sequence[ChunkLike],
    question: str,
    *,
    sink: int = 16,
    style: str = "auto",
    instruction: str = DA_INSTRUCTION,
    history: Sequence[tuple[str, str]] = (),
) -> RenderedPrompt:
    """Render a DA prompt through ``tokenizer``'s chat template and derive its layout.

    ``style="auto"`` tries the tool-use transcript and falls back to ``inline`` when the
    template cannot show tool calls and tool responses; ``"tools"`` or ``"inline"`` forces
    one and raises if the template cannot render it. ``instruction`` opens the first
    user turn after the document; models trained to declare take the brief one.

    ``history``: earlier ``(question, reply)`` turns of a conversation over the same
    document, rendered between the document and ``question``; the instruction opens the
    first of them. The question window then starts at that first turn, so every mode
    reads the earlier questions and replies, as it reads its own response. The document
    comes first and the questions after it, so every question over one document renders
    the same prefix (a prefix cache reuses it).
    """
    require_chat_template(tokenizer)
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    if sink < 0:
        raise ValueError(f"sink must be >= 0, not {sink}")
    chunks = list(chunks)
    if not chunks:
        raise ValueError("a DA prompt needs at least one magic chunk")
    for i, chunk in enumerate(chunks, 1):
        if chunk.id != i:
            raise ValueError(
                f"magic chunk ids must run 1..n in order; position {i} has id {chunk.id}"
            )

    turns = [t for pair in history for t in pair]
    tag = nonce([c.text for c in chunks] + [question, *turns])
    chunk_keys = [f"DASENT{tag}X{i}Y" for i in range(1, len(chunks) + 1)]
    question_key = f"DASENT{tag}QY"
    turn_keys = [f"DASENT{tag}H{i}Y" for i in range(len(turns))]
    keys = [*chunk_keys, *turn_keys, question_key]
    texts = {k: c.text for k, c in zip(chunk_keys, chunks, strict=True)}
    texts.update(zip(turn_keys, turns, strict=True))
    texts[question_key] = question

    after = _question_turns(turn_keys, question_key, instruction)
    chosen, messages, tools, full = _render_da(tokenizer, style, chunk_keys, keys, after)
    first = len(messages) - len(after)  # the first message after the document
    turn_start = _turn_offset(tokenizer, messages, tools, full, first, keys[len(chunk_keys)])
    special = special_ids(tokenizer)
    built = assemble(tokenizer, full, keys, texts, special, turn_start)

    chunk_spans = tuple(built.user_spans[k] for k in chunk_keys)
    first_text = built.user_spans[keys[len(chunk_keys)]]  # the first turn after the document
    q_start = built.boundary if built.boundary is not None else first_text.start
    prompt_len = len(built.ids)
    if sink > chunk_spans[0].start:
        raise ValueError(
            f"a sink of {sink} tokens would cover the start of magic chunk 1 (token "
            f"{chunk_spans[0].start}), so chunk text would always be read; "
            f"pass sink <= {chunk_spans[0].start}"
        )
    layout = Layout(
        prompt_len=prompt_len,
        sink=Span(0, min(sink, prompt_len)),
        chunks=chunk_spans,
        question=Span(q_start, prompt_len),
    )
    for key in keys:
        verify_span(tokenizer, built.ids, built.user_spans[key], texts[key], special)
    if not (chunk_spans[-1].end <= layout.question.start <= first_text.start):
        raise RuntimeError("question window does not sit between the last chunk and the question")
    return RenderedPrompt(token_ids=built.ids, layout=layout, text=built.text, style=chosen)


def render_plain(
    tokenizer: Any, context: str, question: str, history: Sequence[tuple[str, str]] = ()
) -> list[int]:
    """The vanilla arm's prompt: the same system turn, then context and question in one
    user turn, with the same protection of user text against special-token parsing.

    ``history``: earlier ``(question, reply)`` turns; the context opens the first user
    turn and later questions follow as turns of their own, so every question over one
    context renders the same prefix."""
    require_chat_template(tokenizer)
    turns = [t for pair in history for t in pair]
    tag = nonce([context, question, *turns])
    context_key, question_key = f"DASENT{tag}CY", f"DASENT{tag}QY"
    turn_keys = [f"DASENT{tag}H{i}Y" for i in range(len(turns))]
    asked = [*turn_keys[0::2], question_key]
    replies = turn_keys[1::2]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_LINE}]
    for i, key in enumerate(asked):
        content = f"{context_key}\n\n{key}" if i == 0 else key
        messages.append({"role": "user", "content": content})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    full = render_chat(tokenizer, messages, None, generation=True)
    keys = [context_key, *turn_keys, question_key]
    _check_sentinels(full, keys)
    texts = {context_key: context, question_key: question}
    texts.update(zip(turn_keys, turns, strict=True))
    special = special_ids(tokenizer)
    built = assemble(tokenizer, full, keys, texts, special, None)
    for key in keys:
        verify_span(tokenizer, built.ids, built.user_spans[key], texts[key], special)
    return built.ids


# --- conversation -------------------------------------------------------------------


def _chunks_phrase(n: int) -> str:
    return "1 magic chunk" if n == 1 else f"{n} magic chunks, numbered 1 to {n}"


def _question_turns(
    turn_keys: list[str], question_key: str, instruction: str
) -> list[dict[str, Any]]:
    """The turns after the document: earlier questions and replies, then the question.
    The instruction opens the first of them (the final one when there is no history)."""
    asked = [*turn_keys[0::2], question_key]
    replies = turn_keys[1::2]
    out: list[dict[str, Any]] = []
    for i, key in enumerate(asked):
        content = final_turn(key, instruction) if i == 0 else key
        out.append({"role": "user", "content": content})
        if i < len(replies):
            out.append({"role": "assistant", "content": replies[i]})
    return out


def _conversation(
    style: str, chunk_keys: list[str], after: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """Messages, tools, and the opening user text (used to find the first tool call)."""
    n = len(chunk_keys)
    system = {"role": "system", "content": SYSTEM_LINE}
    if style == "tools":
        opener = (
            f"Read the document first. It comes as {_chunks_phrase(n)}; "
            f"fetch each one with the {TOOL_NAME} tool."
        )
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": opener}]
        for i in range(1, n + 1):
            call_id = f"chunk{i:04d}"  # 9 alphanumerics: what the strictest templates want
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": {"id": str(i)}},
            }
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": TOOL_NAME,
                    "content": f"Magic Chunk {i}\n{chunk_keys[i - 1]}",
                }
            )
        return [*messages, *after], [TOOL_SPEC], opener
    opener = (
        f"Read the document below. It comes as {_chunks_phrase(n)}; "
        "each starts with a line 'Magic Chunk N'."
    )
    sections = "\n\n".join(f"Magic Chunk {i}\n{k}" for i, k in enumerate(chunk_keys, 1))
    ack = f"I have read all {n} magic chunks." if n > 1 else "I have read the magic chunk."
    messages = [
        system,
        {"role": "user", "content": f"{opener}\n\n{sections}"},
        {"role": "assistant", "content": ack},
        *after,
    ]
    return messages, None, opener


# --- rendering and checks -----------------------------------------------------------


def _render_da(
    tokenizer: Any,
    style: str,
    chunk_keys: list[str],
    keys: list[str],
    after: list[dict[str, Any]],
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """Render the DA conversation in the first style the template can show faithfully.

    Returns the style used, its messages and tools, and the full render (with sentinels).
    """
    tried = ("tools", "inline") if style == "auto" else (style,)
    failures: list[str] = []
    for attempt in tried:
        messages, tools, opener = _conversation(attempt, chunk_keys, after)
        try:
            full = render_chat(tokenizer, messages, tools, generation=True)
            _check_sentinels(full, keys)
            if attempt == "tools":
                _check_tool_transcript(full, opener, chunk_keys)
        except Exception as err:  # a template may raise anything; auto falls back
            if style != "auto":
                raise ValueError(
                    f"the chat template cannot render the {attempt!r} DA prompt: {err}"
                ) from err
            failures.append(f"{attempt}: {err}")
            continue
        return attempt, messages, tools, full
    raise ValueError("the chat template renders no DA prompt: " + "; ".join(failures))


def _check_sentinels(render: str, keys: list[str]) -> None:
    """Each sentinel exactly once, in conversation order."""
    last = -1
    for key in keys:
        count = render.count(key)
        if count != 1:
            raise ValueError(f"the template rendered a user text {count} times, expected once")
        at = render.index(key)
        if at < last:
            raise ValueError("the template reordered the conversation")
        last = at


def _check_tool_transcript(render: str, opener: str, chunk_keys: list[str]) -> None:
    """Each chunk must follow a visible call of the tool and its response header.

    A template without tool roles often renders an empty assistant turn and a bare
    ``tool`` turn; the model would then see chunks fetched by no visible call.
    """
    at = render.find(opener)
    if at < 0:
        raise ValueError("the template did not render the opening user turn verbatim")
    cursor = at + len(opener)
    for i, key in enumerate(chunk_keys, 1):
        pos = render.index(key)
        header = f"Magic Chunk {i}\n"
        if not render.startswith(header, pos - len(header)):
            raise ValueError(f"the template did not render tool response {i} verbatim")
        if render.find(TOOL_NAME, cursor, pos - len(header)) < 0:
            raise ValueError(f"the template did not render tool call {i}")
        cursor = pos + len(key)


def _turn_offset(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    full: str,
    index: int,
    first_key: str,
) -> int | None:
    """Character offset in ``full`` where message ``index`` (the first user turn after
    the document) begins.

    Where rendering the messages before it is not a prefix of the full render, fall back
    to the start of that turn's content (the instruction, which precedes its question),
    so the question window always holds the instruction; None only if neither is found.
    """
    key_at = full.index(first_key)
    try:
        head = render_chat(tokenizer, messages[:index], tools, generation=False)
    except Exception:  # e.g. a template that refuses to end on a tool turn
        head = None
    if head is not None and full.startswith(head) and len(head) <= key_at:
        return len(head)
    content = messages[index]["content"]
    at = full.rfind(content[: content.index(first_key)], 0, key_at + 1)
    return at if at >= 0 else None




