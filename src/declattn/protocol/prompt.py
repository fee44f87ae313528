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

Why sentinels: user text (chunk bodies, the question) must never turn into template
tokens, and its token span must be known exactly. So the template renders once with a
random sentinel in place of each piece of user text; the render is cut at the
sentinels; template pieces are tokenised with special tokens parsed (they are the
template's own), user pieces with special-token parsing off. The spans then come from
the piece lengths, with no search in token space, and a document full of
``<|im_end|>`` or ``Magic Chunk 3`` can neither inject a turn nor shift a span.

The question window starts at the role header of the final user turn, not at the
question text: the header is scaffold every mode should keep reading, and the span is
found by rendering the conversation without that turn, which must be a prefix of the
full render. Where a template breaks that prefix property, the window starts at the
question text itself (a few header tokens then go unattended in focus and local).

Nothing here imports transformers or torch: the tokenizer is duck-typed (a Hugging
Face tokenizer with a chat template).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from declattn.protocol.instruction import DA_INSTRUCTION, final_turn
from declattn.protocol.layout import Layout, Span

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


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, so no DA prompt can be rendered for it."""


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
) -> RenderedPrompt:
    """Render a DA prompt through ``tokenizer``'s chat template and derive its layout.

    ``style="auto"`` tries the tool-use transcript and falls back to ``inline`` when the
    template cannot show tool calls and tool responses; ``"tools"`` or ``"inline"`` forces
    one and raises if the template cannot render it. ``instruction`` opens the final
    user turn; models trained to declare take the brief one.
    """
    _require_chat_template(tokenizer)
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

    nonce = _nonce([c.text for c in chunks] + [question])
    chunk_keys = [f"DASENT{nonce}X{i}Y" for i in range(1, len(chunks) + 1)]
    question_key = f"DASENT{nonce}QY"
    keys = [*chunk_keys, question_key]
    texts = {k: c.text for k, c in zip(chunk_keys, chunks, strict=True)}
    texts[question_key] = question

    final = final_turn(question_key, instruction)
    chosen, messages, tools, full = _render_da(tokenizer, style, chunk_keys, question_key, final)
    turn_start = _final_turn_offset(tokenizer, messages, tools, full, question_key, final)
    special = _special_ids(tokenizer)
    built = _assemble(tokenizer, full, keys, texts, special, turn_start)

    chunk_spans = tuple(built.user_spans[k] for k in chunk_keys)
    question_text = built.user_spans[question_key]
    q_start = built.boundary if built.boundary is not None else question_text.start
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
    for key, span in zip(chunk_keys, chunk_spans, strict=True):
        _verify_span(tokenizer, built.ids, span, texts[key], special)
    _verify_span(tokenizer, built.ids, question_text, question, special)
    if not (chunk_spans[-1].end <= layout.question.start <= question_text.start):
        raise RuntimeError("question window does not sit between the last chunk and the question")
    return RenderedPrompt(token_ids=built.ids, layout=layout, text=built.text, style=chosen)


def render_plain(tokenizer: Any, context: str, question: str) -> list[int]:
    """The vanilla arm's prompt: the same system turn, then context and question in one
    user turn, with the same protection of user text against special-token parsing."""
    _require_chat_template(tokenizer)
    nonce = _nonce([context, question])
    context_key, question_key = f"DASENT{nonce}CY", f"DASENT{nonce}QY"
    messages = [
        {"role": "system", "content": SYSTEM_LINE},
        {"role": "user", "content": f"{context_key}\n\n{question_key}"},
    ]
    full = _render(tokenizer, messages, None, generation=True)
    keys = [context_key, question_key]
    _check_sentinels(full, keys)
    texts = {context_key: context, question_key: question}
    special = _special_ids(tokenizer)
    built = _assemble(tokenizer, full, keys, texts, special, None)
    for key in keys:
        _verify_span(tokenizer, built.ids, built.user_spans[key], texts[key], special)
    return built.ids


# --- conversation -------------------------------------------------------------------


def _chunks_phrase(n: int) -> str:
    return "1 magic chunk" if n == 1 else f"{n} magic chunks, numbered 1 to {n}"


def _conversation(
    style: str, chunk_keys: list[str], final_text: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """Messages, tools, and the opening user text (used to find the first tool call)."""
    n = len(chunk_keys)
    system = {"role": "system", "content": SYSTEM_LINE}
    final = {"role": "user", "content": final_text}
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
        return [*messages, final], [TOOL_SPEC], opener
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
        final,
    ]
    return messages, None, opener


# --- rendering and checks -----------------------------------------------------------


def _render_da(
    tokenizer: Any, style: str, chunk_keys: list[str], question_key: str, final_text: str
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """Render the DA conversation in the first style the template can show faithfully.

    Returns the style used, its messages and tools, and the full render (with sentinels).
    """
    tried = ("tools", "inline") if style == "auto" else (style,)
    failures: list[str] = []
    for attempt in tried:
        messages, tools, opener = _conversation(attempt, chunk_keys, final_text)
        try:
            full = _render(tokenizer, messages, tools, generation=True)
            _check_sentinels(full, [*chunk_keys, question_key])
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


def _require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise NoChatTemplateError(
            f"tokenizer {name!r} has no chat template, so a DA prompt cannot be rendered "
            "(base models usually ship none); use the tokenizer of an instruction-tuned "
            "model, or set tokenizer.chat_template to a Jinja chat template"
        )


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation: bool,
) -> str:
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=generation,
        enable_thinking=False,
    )
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}")
    return out


def _nonce(user_texts: list[str]) -> str:
    """A random hex string found in no user text, so sentinels cannot collide with it."""
    while True:
        nonce = secrets.token_hex(8)
        if not any(nonce in t for t in user_texts):
            return nonce


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


def _final_turn_offset(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    full: str,
    question_key: str,
    content: str,
) -> int | None:
    """Character offset in ``full`` where the final user turn begins.

    Where rendering without that turn is not a prefix of the full render, fall back to
    the start of the turn's content (the instruction, which precedes the question), so
    the question window always holds the instruction; None only if neither is found.
    """
    q_at = full.index(question_key)
    try:
        head = _render(tokenizer, messages[:-1], tools, generation=False)
    except Exception:  # e.g. a template that refuses to end on a tool turn
        head = None
    if head is not None and full.startswith(head) and len(head) <= q_at:
        return len(head)
    at = full.rfind(content[: -len(question_key)], 0, q_at + 1)
    return at if at >= 0 else None


# --- tokenisation -------------------------------------------------------------------


@dataclass(frozen=True)
class _Assembled:
    ids: list[int]
    text: str
    user_spans: dict[str, Span]
    boundary: int | None  # token index of the requested render offset


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def _special_strings(tokenizer: Any) -> set[str]:
    found = {str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or [])}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(getattr(tok, "content", tok)))
    return {s for s in found if s}


def encode_user_text(tokenizer: Any, text: str, special: frozenset[int] | None = None) -> list[int]:
    """Token ids for user text with no special token parsed out of it.

    ``split_special_tokens=True`` does this for Hugging Face tokenizers; for one that
    ignores the flag, the text is cut one character into every special-token string
    and the cuts are encoded apart, so no piece can spell a whole special token.
    """
    if not text:
        return []
    special = _special_ids(tokenizer) if special is None else special
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if special.isdisjoint(ids):
        return ids
    cuts = set()
    for s in _special_strings(tokenizer):
        if len(s) < 2:
            continue
        at = text.find(s)
        while at >= 0:
            cuts.add(at + 1)
            at = text.find(s, at + 1)
    bounds = [0, *sorted(cuts), len(text)]
    ids = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        if a < b:
            ids.extend(tokenizer(text[a:b], add_special_tokens=False)["input_ids"])
    if not special.isdisjoint(ids):
        raise ValueError("cannot tokenise user text without producing special tokens")
    return ids


def _assemble(
    tokenizer: Any,
    render: str,
    keys: list[str],
    texts: dict[str, str],
    special: frozenset[int],
    boundary_char: int | None,
) -> _Assembled:
    """Tokenise the render piece by piece: template text parsed, user text protected."""
    pieces: list[tuple[int, int, str | None]] = []  # (render start, render end, key)
    cursor = 0
    for key in keys:
        at = render.index(key)
        pieces.append((cursor, at, None))
        pieces.append((at, at + len(key), key))
        cursor = at + len(key)
    pieces.append((cursor, len(render), None))

    ids: list[int] = []
    shown: list[str] = []
    spans: dict[str, Span] = {}
    boundary: int | None = None
    for start, end, key in pieces:
        if key is not None:
            piece_ids = encode_user_text(tokenizer, texts[key], special)
            spans[key] = Span(len(ids), len(ids) + len(piece_ids))
            shown.append(texts[key])
        else:
            piece = render[start:end]
            wants_offsets = boundary_char is not None and start <= boundary_char < end
            if wants_offsets:
                piece_ids, boundary = _encode_with_boundary(tokenizer, piece, boundary_char - start)
                if boundary is not None:
                    boundary += len(ids)
            else:
                piece_ids = list(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if boundary_char is not None and boundary_char == end and end > start:
                boundary = len(ids) + len(piece_ids)
            shown.append(piece)
        ids.extend(piece_ids)

    bos_id = getattr(tokenizer, "bos_token_id", None)
    if (
        getattr(tokenizer, "add_bos_token", False)
        and bos_id is not None
        and (not ids or ids[0] != bos_id)
    ):
        # The template did not write BOS but the model expects one.
        ids.insert(0, int(bos_id))
        shown.insert(0, str(getattr(tokenizer, "bos_token", "") or ""))
        spans = {k: Span(s.start + 1, s.end + 1) for k, s in spans.items()}
        boundary = None if boundary is None else boundary + 1
    return _Assembled(ids=ids, text="".join(shown), user_spans=spans, boundary=boundary)


def _encode_with_boundary(tokenizer: Any, piece: str, offset: int) -> tuple[list[int], int | None]:
    """Ids of a template piece and the index of the token holding character ``offset``.

    A token that straddles the offset is counted in, so the window errs towards
    reading one more token rather than one fewer.
    """
    try:
        enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except Exception:  # slow tokenizers have no offsets
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"]), None
    piece_ids = list(enc["input_ids"])
    for index, (_, tok_end) in enumerate(offsets):
        if tok_end > offset:
            return piece_ids, index
    return piece_ids, len(piece_ids)


def _verify_span(
    tokenizer: Any, ids: list[int], span: Span, text: str, special: frozenset[int]
) -> None:
    """The span must decode to its text (or to the tokenizer's own round trip of it)."""
    piece = ids[span.start : span.end]
    if not special.isdisjoint(piece):
        raise RuntimeError(f"special token inside user text span [{span.start}, {span.end})")
    got = _decode(tokenizer, piece)
    if got == text:
        return
    if got != _decode(tokenizer, encode_user_text(tokenizer, text, special)):
        raise RuntimeError(f"span [{span.start}, {span.end}) does not decode to its text")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
