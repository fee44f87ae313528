"""A chat conversation -> a DA prompt whose magic chunks are its own earlier messages.

``render_prompt`` builds a DA prompt around one document. An agent transcript or a long
chat already has natural segments: each earlier message (user turns, assistant replies,
assistant tool calls, tool results, documents pasted in a turn) becomes a magic chunk,
in order, rendered where the model's chat template puts it. The system message(s) and
the final user turn are scaffold; the final turn's content becomes
``final_turn(question, instruction)``, and the question window starts at its role header.
Big messages are cut by the segmenter (each piece a chunk, none over ``cap``); tiny
neighbours are merged until they reach about ``min_tokens``.

How the layout is found (the sentinel technique of ``prompt.py``, extended):

- every piece of client text (each message's content, each tool call's name, each
  string key and value of its arguments) is replaced by a random sentinel, and the
  conversation is rendered once that way and once with the real text; the sentinel
  render, with each sentinel replaced by its text as the template writes it (verbatim,
  trimmed, or JSON-escaped: the one choice that reproduces the real render exactly),
  must equal the real render, or the template rewrites text and a clear error says so;
- a message's chunk is its *body*: its content and, for a tool-call message, the call
  as the template renders it (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  in Qwen's). The body of a tool-call message is where its render differs from the same
  message holding only a sentinel as content (rendered alone, or, where the template
  refuses that, with the messages before it);
- the render is tokenised in pieces: template text with special tokens parsed, client
  text with special-token parsing off, cut at every sentinel and at every body edge, so
  the spans come from piece lengths and ``<|im_end|>`` or ``<focus magic_chunks="1">``
  inside any message can add no turn and shift no span.

Prefix stability: every cut depends only on the message it sits in, and the final turn's
content starts a piece of its own, so a follow-up request that appends a reply and a new
user turn tokenises the earlier conversation into the same ids, up to the content of the
previous request's final turn; the engine's prefix cache reuses them. Rendering the
conversation without its final turn must be a prefix of the whole render (checked:
otherwise neither the window nor the reuse can be trusted).

Templates that do not render tool calls (SmolLM2's) get them inline, as the text Qwen's
template writes, so the model still sees what was called; ``tool_calls`` says which.
``render_plain_messages`` renders the same chat for a vanilla request (no chunks, no
instruction; calls inline likewise), so the two arms read the same conversation.
Nothing here imports torch or transformers: the tokenizer is duck-typed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from declattn.protocol.instruction import DA_INSTRUCTION, final_turn
from declattn.protocol.layout import Layout, Span
from declattn.protocol.segment import SegmentError, segment
from declattn.protocol.template import (
    assemble,
    decode,
    encode_user_text,
    nonce,
    render_chat,
    require_chat_template,
    special_ids,
    special_strings,
    verify_span,
)

SCAFFOLD_ROLES = frozenset({"system", "developer"})
"""Roles whose messages stay scaffold (always read) wherever they sit."""

MIN_TOKENS_DIVISOR = 8
"""``min_tokens`` defaults to ``target // 8``, 256 for 2,048 (why: ``render_messages``)."""

_CONTENT_FORMS = ("raw", "strip", "json", "ascii")
_ARG_FORMS = ("json", "ascii", "raw")


class NoChunksError(ValueError):
    """The conversation has no earlier message with text: nothing to make a chunk of.

    A caller can run such a request vanilla (DA has nothing to skip) and say so."""


@dataclass(frozen=True)
class MessageChunk:
    """One magic chunk of a chat: ``id`` from 1, the token ``span`` in the prompt, the exact
    ``text`` it decodes to (``MessagesPrompt.text[chars[0]:chars[1]]``), and the indices of
    the request's messages it holds (one; several when tiny ones were merged, the template
    text between them included; a big message's pieces each name that message)."""

    id: int
    text: str
    messages: tuple[int, ...]
    span: Span
    chars: tuple[int, int]


@dataclass(frozen=True)
class MessageSpan:
    """Where one request message sits: ``kind`` is ``chunk``, ``scaffold`` (system),
    ``question`` (the final user turn: its span is the user's own text) or ``empty``
    (no text, no span). ``chars`` index ``MessagesPrompt.text``."""

    index: int
    role: str
    kind: str
    chars: tuple[int, int] | None
    tokens: Span | None
    chunk_ids: tuple[int, ...]


@dataclass(frozen=True)
class MessagesPrompt:
    """A message-chunked DA prompt ready for prefill.

    ``tool_calls`` is ``none`` (no message calls a tool), ``native`` (the template renders
    the calls) or ``inline`` (it does not, so they were written into the content).
    """

    token_ids: list[int]
    layout: Layout
    text: str
    chunks: tuple[MessageChunk, ...]
    messages: tuple[MessageSpan, ...]
    tool_calls: str

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``ids, layout = render_messages(...)``, like ``RenderedPrompt``."""
        yield self.token_ids
        yield self.layout


def render_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    target: int = 2048,
    cap: int = 2560,
    min_tokens: int | None = None,
    sink: int = 16,
    instruction: str = DA_INSTRUCTION,
) -> MessagesPrompt:
    """Render an OpenAI-style chat with each earlier message as a magic chunk.

    ``messages`` are dicts with ``role``, ``content`` (a string or None; join text parts
    first), and for assistants optional ``tool_calls`` (``arguments`` a JSON string or a
    dict), for tools ``tool_call_id``/``name``; other keys are ignored. The last message
    must be a user turn. ``count_tokens`` sizes text for splitting; by default it counts
    the protected tokenisation the prompt is built with, so ``cap`` holds on the real
    spans. ``min_tokens`` (default ``target // 8``, 256): with 16-token blocks a chunk
    that small still spans 16 blocks, so rounding a focus outward wastes at most two of
    them, while the chit-chat turns of a long chat (tens of tokens each) no longer make
    dozens of ids a model would have to pick from; documents and tool results of a few
    hundred tokens stay chunks of their own. ``min_tokens=0`` merges nothing. ``sink`` is
    at most the tokens before chunk 1 (the client's conversation decides how many).
    """
    require_chat_template(tokenizer)
    min_tokens = target // MIN_TOKENS_DIVISOR if min_tokens is None else min_tokens
    _check_sizes(target, cap, min_tokens, sink)
    msgs = _normalise(messages)
    _require_chunk_text(msgs)
    special = special_ids(tokenizer)
    specials = special_strings(tokenizer)
    _check_plain_fields(msgs, tools, specials)
    if count_tokens is None:

        def count_tokens(text: str) -> int:
            return len(encode_user_text(tokenizer, text, special))

    r = _render_sentinels(tokenizer, msgs, tools, instruction)
    keys, msgs = r.keys, r.msgs
    turn_start = _final_turn_start(tokenizer, r.sent, tools, r.full, r.where, keys)
    bodies = _bodies(tokenizer, r.sent, tools, r.full, r.where, keys, msgs)
    pieces = _split_pieces(keys, r.forms, msgs, count_tokens, target, cap)
    asm = _Assembly.build(r.full, r.where, keys, pieces, bodies, turn_start)
    built = assemble(tokenizer, asm.render, asm.order, asm.texts, special, asm.boundary)
    shift = len(built.text) - len(asm.text)  # a BOS the template did not write
    if built.text[shift:] != asm.text:
        raise RuntimeError("assembled prompt text does not match the template render")
    for key in asm.order:
        verify_span(tokenizer, built.ids, built.user_spans[key], asm.texts[key], special)

    def tok(key: str) -> Span:
        return built.user_spans[key]

    def char(key: str, end: bool = False) -> int:
        return asm.chars[key] + shift + (len(asm.texts[key]) if end else 0)

    candidates = _chunk_candidates(msgs, bodies, asm, tok, char, target, cap)
    scaffold = frozenset(p for p, m in enumerate(msgs) if m.role in SCAFFOLD_ROLES)
    groups = _merge(candidates, scaffold, min_tokens, target)
    if not groups:
        raise NoChunksError(
            "the conversation has no earlier message with text, so there is no magic "
            "chunk to focus on; run it without Declarative Attention"
        )
    chunks = tuple(
        MessageChunk(
            id=i,
            text=built.text[g.chars[0] : g.chars[1]],
            messages=g.messages,
            span=g.span,
            chars=g.chars,
        )
        for i, g in enumerate(groups, 1)
    )
    for c in chunks:
        _verify_chunk(tokenizer, built.ids, c, special)
    instr_key = keys.final_instruction
    q_start = built.boundary if built.boundary is not None else tok(asm.first[instr_key]).start
    # The client's conversation decides what precedes chunk 1 (a short system prompt, or
    # none): the sink is at most what is there, never chunk text that is always read.
    sink = min(sink, chunks[0].span.start)
    if chunks[-1].span.end > q_start:
        raise RuntimeError("the question window starts inside the last magic chunk")
    n = len(built.ids)
    layout = Layout(
        prompt_len=n,
        sink=Span(0, min(sink, n)),
        chunks=tuple(c.span for c in chunks),
        question=Span(q_start, n),
    )
    spans = _message_spans(msgs, chunks, keys, asm, tok, char)
    return MessagesPrompt(built.ids, layout, built.text, chunks, spans, r.style)


def render_plain_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The vanilla prompt of a chat: the template's rendering of ``messages`` with the
    final user turn as it is (no instruction), tokenised with the same protection of
    client text as ``render_messages``, and tool calls written inline where the template
    drops them. A vanilla arm then reads the very conversation a message-chunked DA
    prompt reads, less the instruction, and a follow-up that appends a reply and a user
    turn extends the previous prompt's ids (the prefix cache reuses all of them)."""
    require_chat_template(tokenizer)
    msgs = _normalise(messages)
    special = special_ids(tokenizer)
    _check_plain_fields(msgs, tools, special_strings(tokenizer))
    r = _render_sentinels(tokenizer, msgs, tools, None)
    order = sorted(r.where, key=r.where.__getitem__)
    built = assemble(tokenizer, r.full, order, r.forms, special, None)
    for key in order:
        verify_span(tokenizer, built.ids, built.user_spans[key], r.forms[key], special)
    return built.ids


# --- input ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Msg:
    index: int
    role: str
    content: str
    calls: tuple[dict[str, Any], ...]  # {"id"?, "name", "arguments"}
    extra: tuple[tuple[str, str], ...]  # name, tool_call_id: passed through as they are


def _check_sizes(target: int, cap: int, min_tokens: int, sink: int) -> None:
    if isinstance(target, bool) or not isinstance(target, int) or target <= 0:
        raise ValueError(f"target must be a positive number of tokens, got {target!r}")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < target:
        raise ValueError(f"cap must be an integer at least the target ({target}), got {cap!r}")
    if not 0 <= min_tokens <= target:
        raise ValueError(f"min_tokens must be between 0 and the target ({target}), "
                         f"got {min_tokens}")
    if sink < 0:
        raise ValueError(f"sink must be >= 0, not {sink}")


def _normalise(messages: Sequence[Mapping[str, Any]]) -> list[_Msg]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("the conversation is empty: it needs at least a final user message")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object with a role, not {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} needs a role (system, user, assistant or tool)")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or null (join text parts "
                             f"first), not {type(content).__name__}")
        calls = tuple(_normal_call(c, f"{where}.tool_calls[{j}]")
                      for j, c in enumerate(m.get("tool_calls") or ()))
        if calls and role != "assistant":
            raise ValueError(f"{where}: only an assistant message can carry tool_calls")
        extra = []
        for name in ("name", "tool_call_id"):
            value = m.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"{where}.{name} must be a string")
                extra.append((name, value))
        out.append(_Msg(i, role, content, calls, tuple(extra)))
    last = out[-1]
    if last.role != "user":
        raise ValueError(f"the final message must be a user turn (the question); "
                         f"messages[{last.index}] is {last.role!r}")
    if not last.content.strip():
        raise ValueError(f"the final user message (messages[{last.index}]) is empty")
    return out


def _require_chunk_text(msgs: list[_Msg]) -> None:
    if not any((m.content.strip() or m.calls) and m.role not in SCAFFOLD_ROLES for m in msgs[:-1]):
        raise NoChunksError(
            "the conversation has no earlier message with text, so there is no magic "
            "chunk to focus on; run it without Declarative Attention"
        )


def _normal_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call as a template wants it: ``arguments`` parsed into a dict (what
    Hugging Face templates and vLLM expect), left a string only if it is not a JSON object."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    elif not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object")
    out: dict[str, Any] = {"name": name, "arguments": args}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise ValueError(f"{where}.id must be a string")
        out["id"] = call["id"]
    return out


def _check_plain_fields(
    msgs: list[_Msg], tools: list[dict[str, Any]] | None, specials: set[str]
) -> None:
    """Fields rendered as they are (ids, names, tool definitions) must spell no special
    token: they are tokenised as template text."""
    fields = [(f"messages[{m.index}].{k}", v) for m in msgs for k, v in m.extra]
    fields += [(f"messages[{m.index}].tool_calls[{j}].id", c["id"])
               for m in msgs for j, c in enumerate(m.calls) if "id" in c]
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list of tool definitions")
        fields.append(("tools", json.dumps(tools, ensure_ascii=False)))
    for where, text in fields:
        hit = next((s for s in specials if len(s) > 1 and s in text), None)
        if hit is not None:
            raise ValueError(f"{where} contains the special token {hit!r}")


def _user_texts(msgs: list[_Msg], tools: Any, instruction: str | None) -> list[str]:
    texts = [instruction or "", json.dumps(tools, ensure_ascii=False)]
    for m in msgs:
        texts.append(m.content)
        texts.extend(v for _, v in m.extra)
        texts.extend(json.dumps(c, ensure_ascii=False) for c in m.calls)
    return texts


def _inline_calls(m: _Msg) -> _Msg:
    """The calls as Qwen's template writes them, appended to the content."""
    if not m.calls:
        return m
    text = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in m.calls
    )
    return replace(m, content=f"{m.content}\n{text}" if m.content else text, calls=())


def _real_messages(
    msgs: list[_Msg], question: str, instruction: str | None
) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        final = m is msgs[-1] and instruction is not None
        content = final_turn(question, instruction) if final else m.content
        out.append(_message_dict(m, content, [(c["name"], c["arguments"]) for c in m.calls]))
    return out


def _message_dict(
    m: _Msg, content: str, calls: list[tuple[str, Any]]
) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": content, **dict(m.extra)}
    if calls:
        d["tool_calls"] = [
            {**({"id": c["id"]} if "id" in c else {}), "type": "function",
             "function": {"name": name, "arguments": args}}
            for c, (name, args) in zip(m.calls, calls, strict=True)
        ]
    return d


# --- sentinels ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Key:
    key: str
    value: str
    message: int  # position in the message list
    kind: str  # "content" or "arg" (its template form is chosen per kind)
    text_of: str  # "content", "question", "instruction", "name", "arg"
    edge: str  # which ends a trimming template strips: "both", "left", "right"


class _Keys:
    """Sentinels for one render, in the order they were made."""

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.all: list[_Key] = []
        self.by_key: dict[str, _Key] = {}
        self.by_message: dict[int, list[_Key]] = {}
        self.final_instruction = ""
        self.pattern = re.compile(rf"DASENT{nonce}[A-Z]\d+Y")

    def new(self, value: str, message: int, kind: str, text_of: str, edge: str = "both") -> str:
        key = f"DASENT{self.nonce}K{len(self.all)}Y"
        k = _Key(key, value, message, kind, text_of, edge)
        self.all.append(k)
        self.by_key[key] = k
        self.by_message.setdefault(message, []).append(k)
        return key

    def of(self, message: int) -> list[_Key]:
        return self.by_message.get(message, [])

    def fresh(self, letter: str, n: int) -> str:
        return f"DASENT{self.nonce}{letter}{n}Y"

    def messages(
        self, msgs: list[_Msg], question: str, instruction: str | None
    ) -> list[dict[str, Any]]:
        """``instruction`` None: the final turn as it is (a plain chat)."""
        out = []
        for pos, m in enumerate(msgs):
            if pos == len(msgs) - 1 and instruction is None:
                content = self.new(question, pos, "content", "question")
            elif pos == len(msgs) - 1:  # the final turn: instruction, then the question
                self.final_instruction = self.new(instruction, pos, "content", "instruction",
                                                  "left")
                content = final_turn(self.new(question, pos, "content", "question", "right"),
                                     self.final_instruction)
            else:
                content = self.new(m.content, pos, "content", "content") if m.content else ""
            calls = [(self.new(c["name"], pos, "arg", "name"), self._args(c["arguments"], pos))
                     for c in m.calls]
            out.append(_message_dict(m, content, calls))
        return out

    def _args(self, value: Any, pos: int) -> Any:
        if isinstance(value, str):
            return self.new(value, pos, "arg", "arg")
        if isinstance(value, dict):
            return {self._args(str(k), pos): self._args(v, pos) for k, v in value.items()}
        if isinstance(value, list):
            return [self._args(v, pos) for v in value]
        return value  # numbers, booleans, null: no text to protect


@dataclass(frozen=True)
class _Rendered:
    """The conversation rendered with sentinels: ``full`` (generation prompt included),
    where each key sits in it, and each key's text as the template writes it."""

    style: str
    msgs: list[_Msg]
    keys: _Keys
    sent: list[dict[str, Any]]
    full: str
    where: dict[str, int]
    forms: dict[str, str]


def _render_sentinels(
    tokenizer: Any, msgs: list[_Msg], tools: Any, instruction: str | None
) -> _Rendered:
    """Render with sentinels, natively; where the template drops the tool calls, again
    with the calls written into the content; then check it against the real render."""
    question = msgs[-1].content
    keys = _Keys(nonce(_user_texts(msgs, tools, instruction)))
    style = "native" if any(m.calls for m in msgs) else "none"
    sent = keys.messages(msgs, question, instruction)
    full = _render_or_fail(tokenizer, sent, tools)
    where = _locate(full, keys)
    if style == "native" and any(k.text_of == "name" and k.key not in where for k in keys.all):
        style = "inline"
        msgs = [_inline_calls(m) for m in msgs]
        keys = _Keys(keys.nonce)
        sent = keys.messages(msgs, question, instruction)
        full = _render_or_fail(tokenizer, sent, tools)
        where = _locate(full, keys)
    _check_all_rendered(keys, where, msgs)
    real = _render_or_fail(tokenizer, _real_messages(msgs, question, instruction), tools)
    forms = _template_forms(full, where, keys, real)
    return _Rendered(style, msgs, keys, sent, full, where, forms)


def _render_or_fail(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    try:
        return render_chat(tokenizer, messages, tools, generation=True)
    except Exception as err:  # a template raises anything (role order, missing fields)
        raise ValueError(f"the chat template cannot render these messages: {err}") from err


def _locate(render: str, keys: _Keys) -> dict[str, int]:
    where: dict[str, int] = {}
    for m in keys.pattern.finditer(render):
        if m.group() in where:
            raise ValueError("the chat template renders a message's text twice; its spans "
                             "would be ambiguous")
        where[m.group()] = m.start()
    return where


def _check_all_rendered(keys: _Keys, where: dict[str, int], msgs: list[_Msg]) -> None:
    """Every text rendered, and each message's texts before the next message's."""
    last_end = -1
    for pos, m in enumerate(msgs):
        mine = keys.of(pos)
        missing = [k for k in mine if k.key not in where]
        if missing:
            raise ValueError(f"the chat template does not render messages[{m.index}] "
                             f"({m.role}): its {missing[0].text_of} would be invisible")
        if mine:
            start = min(where[k.key] for k in mine)
            if start < last_end:
                raise ValueError("the chat template reorders the conversation")
            last_end = max(where[k.key] + len(k.key) for k in mine)


def _form(value: str, form: str, edge: str) -> str:
    if form == "raw":
        return value
    if form == "strip":
        return {"both": value.strip, "left": value.lstrip, "right": value.rstrip}[edge]()
    return json.dumps(value, ensure_ascii=form == "ascii")[1:-1]


def _substitute(render: str, where: dict[str, int], texts: Mapping[str, str]) -> str:
    out, cursor = [], 0
    for key, at in sorted(where.items(), key=lambda kv: kv[1]):
        out += [render[cursor:at], texts[key]]
        cursor = at + len(key)
    out.append(render[cursor:])
    return "".join(out)


def _template_forms(
    render: str, where: dict[str, int], keys: _Keys, real: str
) -> dict[str, str]:
    """Each key's text as the template writes it (verbatim, trimmed or JSON-escaped).

    Walking both renders in step, a key's form is the one after which the real render
    goes on with the same template text as the sentinel render; templates choose per role
    (Llama's writes tool results as JSON, everything else trimmed), so each key chooses
    alone. The whole substitution must then give the real render exactly.
    """
    order = sorted(where.items(), key=lambda kv: kv[1])
    texts: dict[str, str] = {}
    delta = 0  # offset in ``real`` minus offset in ``render``
    for j, (key, at) in enumerate(order):
        k = keys.by_key[key]
        gap = render[at + len(key) : order[j + 1][1] if j + 1 < len(order) else len(render)]
        here = at + delta
        for form in _CONTENT_FORMS if k.kind == "content" else _ARG_FORMS:
            text = _form(k.value, form, k.edge)
            if real.startswith(text, here) and real.startswith(gap, here + len(text)):
                break
        else:
            break
        texts[key] = text
        delta += len(text) - len(key)
    if len(texts) != len(order) or _substitute(render, where, texts) != real:
        raise ValueError("the chat template does not render message text verbatim (it "
                         "rewrites it beyond trimming or JSON escaping), so chunk spans "
                         "cannot be taken from its rendering")
    return texts


def _final_turn_start(
    tokenizer: Any, sent: list[dict[str, Any]], tools: Any, full: str,
    where: dict[str, int], keys: _Keys,
) -> int:
    """Character offset of the final user turn: the render without it must be a prefix."""
    try:
        head = render_chat(tokenizer, sent[:-1], tools, generation=False)
    except Exception as err:  # e.g. a template that refuses to end on a tool turn
        raise ValueError(f"the chat template cannot render the conversation without its final "
                         f"user turn ({err}), so the question window cannot be found") from err
    if not full.startswith(head) or len(head) > where[keys.final_instruction]:
        raise ValueError("the chat template is not prefix-stable: the conversation without its "
                         "final user turn does not render as a prefix of the whole, so neither "
                         "the question window nor a cached prefix can be trusted")
    return len(head)


# --- bodies ---------------------------------------------------------------------------


def _bodies(
    tokenizer: Any, sent: list[dict[str, Any]], tools: Any, full: str,
    where: dict[str, int], keys: _Keys, msgs: list[_Msg],
) -> dict[int, tuple[int, int]]:
    """Character range in ``full`` of each earlier message's body (messages with text)."""
    out: dict[int, tuple[int, int]] = {}
    prev_end = 0
    ranked = [sorted((where[k.key], k.key) for k in keys.of(pos)) for pos in range(len(msgs))]
    for pos in range(len(msgs) - 1):
        mine = ranked[pos]
        if not mine:
            continue
        lo, hi = mine[0][0], mine[-1][0] + len(mine[-1][1])
        if msgs[pos].calls:
            nxt = next(r[0][0] for r in ranked[pos + 1 :] if r)  # the final turn has keys
            lo, hi = _call_body(tokenizer, sent, pos, tools, full, (lo, hi), mine,
                                (prev_end, nxt), keys)
        out[pos] = (lo, hi)
        prev_end = hi
    return out


def _call_body(
    tokenizer: Any, sent: list[dict[str, Any]], pos: int, tools: Any, full: str,
    keys_range: tuple[int, int], mine: list[tuple[int, str]], bounds: tuple[int, int],
    keys: _Keys,
) -> tuple[int, int]:
    """A tool-call message's body: where its render differs from the same message with a
    frame sentinel as its only content. Rendered alone first (cheap), then with the
    messages before it; the body found must sit in ``full`` verbatim, between its
    neighbours' texts. Failing both, the body is the range of its own sentinels."""
    frame = f"QZ{keys.nonce}ZQ"  # starts and ends unlike any sentinel or template text
    first_key, last_key = mine[0][1], mine[-1][1]
    for window in (sent[pos : pos + 1], sent[: pos + 1]):
        try:
            a = render_chat(tokenizer, window, tools, generation=False)
            b = render_chat(tokenizer, [*window[:-1], {"role": "assistant", "content": frame}],
                        tools, generation=False)
        except Exception:  # a template may refuse a window; try the next
            continue
        if first_key not in a or last_key not in a:
            continue
        a_first, a_last = a.index(first_key), a.index(last_key) + len(last_key)
        start = min(_common_prefix(a, b), a_first)
        end = max(len(a) - _common_prefix(a[::-1], b[::-1]), a_last)
        s = keys_range[0] - (a_first - start)
        e = s + (end - start)
        if bounds[0] <= s and e <= bounds[1] and full[s:e] == a[start:end]:
            return s, e
    return keys_range


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- pieces and assembly --------------------------------------------------------------


def _split_pieces(
    keys: _Keys, forms: dict[str, str], msgs: list[_Msg],
    count_tokens: Callable[[str], int], target: int, cap: int,
) -> dict[str, list[str]]:
    """Each key's text, cut by the segmenter where it alone is over the cap (chunk
    messages only: the scaffold is never split)."""
    out: dict[str, list[str]] = {}
    last = len(msgs) - 1
    for k in keys.all:
        text = forms[k.key]
        if k.message != last and msgs[k.message].role not in SCAFFOLD_ROLES and \
                len(text.encode()) > cap and count_tokens(text) > cap:
            try:
                out[k.key] = [c.text for c in segment(text, count_tokens, target, cap)]
            except SegmentError as err:
                raise ValueError(f"messages[{msgs[k.message].index}]: {err}") from err
        else:
            out[k.key] = [text]
    return out


@dataclass
class _Assembly:
    """The render with each key replaced by its pieces' keys and a marker at each body
    edge: what ``assemble`` tokenises. ``first``/``last`` map an original key to its
    first/last piece key, ``edges`` a message to its (start, end) marker keys, ``chars``
    every key to its offset in ``text`` (the prompt text, without a prepended BOS)."""

    render: str
    order: list[str]
    texts: dict[str, str]
    chars: dict[str, int]
    first: dict[str, str]
    last: dict[str, str]
    edges: dict[int, tuple[str, str]]
    text: str
    boundary: int | None

    @classmethod
    def build(
        cls, full: str, where: dict[str, int], keys: _Keys, pieces: dict[str, list[str]],
        bodies: dict[int, tuple[int, int]], turn_start: int,
    ) -> _Assembly:
        # (position, rank, characters replaced, what goes there); markers before keys
        # at the same offset, a body's end marker before the next body's start marker.
        events: list[tuple[int, int, int, str]] = [
            (at, 2, len(key), key) for key, at in where.items()
        ]
        for pos, (lo, hi) in bodies.items():
            events += [(lo, 1, 0, f"start{pos}"), (hi, 0, 0, f"end{pos}")]
        events.sort()
        asm = cls(render="", order=[], texts={}, chars={}, first={}, last={}, edges={},
                  text="", boundary=None)
        a_parts: list[str] = []
        t_parts: list[str] = []
        a_len = t_len = cursor = 0
        starts: dict[int, str] = {}
        for at, _, length, what in events:
            gap = full[cursor:at]
            if asm.boundary is None and cursor <= turn_start <= at:
                asm.boundary = a_len + (turn_start - cursor)
            a_parts.append(gap)
            t_parts.append(gap)
            a_len += len(gap)
            t_len += len(gap)
            if what in where:
                texts = pieces[what]
            else:
                texts = [""]
            made = []
            for text in texts:
                key = keys.fresh("P", len(asm.order))
                made.append(key)
                asm.order.append(key)
                asm.texts[key] = text
                asm.chars[key] = t_len
                a_parts.append(key)
                t_parts.append(text)
                a_len += len(key)
                t_len += len(text)
            if what in where:
                asm.first[what], asm.last[what] = made[0], made[-1]
            elif what.startswith("start"):
                starts[int(what[5:])] = made[0]
            else:
                pos = int(what[3:])
                asm.edges[pos] = (starts[pos], made[0])
            cursor = at + length
        if asm.boundary is None and cursor <= turn_start:
            asm.boundary = a_len + (turn_start - cursor)
        a_parts.append(full[cursor:])
        t_parts.append(full[cursor:])
        asm.render = "".join(a_parts)
        asm.text = "".join(t_parts)
        return asm


# --- chunks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    """A chunk before merging: one message's body, or one piece of a big one."""

    messages: tuple[int, ...]  # positions in the message list
    span: Span
    chars: tuple[int, int]
    whole: bool  # the message's whole body (only those merge)


def _chunk_candidates(
    msgs: list[_Msg], bodies: dict[int, tuple[int, int]], asm: _Assembly,
    tok: Callable[[str], Span], char: Callable[..., int], target: int, cap: int,
) -> list[_Candidate]:
    out = []
    for pos, m in enumerate(msgs[:-1]):
        if m.role in SCAFFOLD_ROLES or pos not in bodies:
            continue
        start_key, end_key = asm.edges[pos]
        body = Span(tok(start_key).start, tok(end_key).end)
        lo, hi = char(start_key), char(end_key)
        if not body:
            continue  # a body with no tokens (trimmed to nothing): no chunk
        if len(body) <= cap:
            out.append(_Candidate((pos,), body, (lo, hi), True))
            continue
        # Units: the message's piece keys; cut before a unit where the chunk would pass
        # the target, so segmenter pieces and argument values stay whole.
        units = [k for k in asm.order if lo <= char(k) < hi and tok(k).start > body.start]
        cuts: list[str] = []
        cur = body.start
        for j, key in enumerate(units):
            nxt = tok(units[j + 1]).start if j + 1 < len(units) else body.end
            if nxt - cur > target and tok(key).start > cur:
                cuts.append(key)
                cur = tok(key).start
        edges = [(body.start, lo), *((tok(k).start, char(k)) for k in cuts), (body.end, hi)]
        for (ts, cs), (te, ce) in zip(edges, edges[1:], strict=False):
            if te - ts > cap:
                raise ValueError(f"messages[{m.index}]: a piece of {te - ts} tokens cannot "
                                 f"be cut under the cap of {cap}")
            out.append(_Candidate((pos,), Span(ts, te), (cs, ce), False))
    return out


def _merge(
    candidates: list[_Candidate], scaffold: frozenset[int], min_tokens: int, target: int
) -> list[_Candidate]:
    """Merge runs of whole messages under ``min_tokens`` until a run reaches it: never past
    the target, never across a scaffold message (its text would join a chunk) or a piece
    of a split one. Empty messages in between do not break a run."""
    out: list[_Candidate] = []
    for c in candidates:
        g = out[-1] if out else None
        if (
            g is not None
            and g.whole
            and c.whole
            and len(c.span) < min_tokens
            and len(g.span) < min_tokens
            and c.span.end - g.span.start <= target
            and not any(g.messages[-1] < p < c.messages[0] for p in scaffold)
        ):
            out[-1] = _Candidate(g.messages + c.messages, Span(g.span.start, c.span.end),
                                 (g.chars[0], c.chars[1]), True)
        else:
            out.append(c)
    return out


def _verify_chunk(
    tokenizer: Any, ids: list[int], chunk: MessageChunk, special: frozenset[int]
) -> None:
    """The span decodes to the chunk's text (or to the tokenizer's own round trip of it,
    for a character its vocabulary cannot spell). Each client piece inside was checked
    on its own for special tokens; a merged chunk holds the template's between them."""
    got = decode(tokenizer, ids[chunk.span.start : chunk.span.end])
    if got != chunk.text and got != decode(
        tokenizer, encode_user_text(tokenizer, chunk.text, special)
    ):
        raise RuntimeError(f"magic chunk {chunk.id} does not decode to its text")


def _message_spans(
    msgs: list[_Msg], chunks: tuple[MessageChunk, ...], keys: _Keys, asm: _Assembly,
    tok: Callable[[str], Span], char: Callable[..., int],
) -> tuple[MessageSpan, ...]:
    chunk_ids: dict[int, list[int]] = {}
    for c in chunks:
        for pos in c.messages:
            chunk_ids.setdefault(pos, []).append(c.id)
    out = []
    last = len(msgs) - 1
    for pos, m in enumerate(msgs):
        ids = tuple(chunk_ids.get(pos, ()))
        if ids:
            start_key, end_key = asm.edges[pos]
            out.append(MessageSpan(m.index, m.role, "chunk", (char(start_key), char(end_key)),
                                   Span(tok(start_key).start, tok(end_key).end), ids))
            continue
        own = [k for k in keys.of(pos) if k.text_of in ("content", "question")]
        kind = "question" if pos == last else "scaffold" if m.role in SCAFFOLD_ROLES else ""
        if not kind or not own:  # a message without text (or one trimmed to nothing)
            out.append(MessageSpan(m.index, m.role, "empty", None, None, ()))
            continue
        a, b = asm.first[own[0].key], asm.last[own[0].key]
        out.append(MessageSpan(m.index, m.role, kind, (char(a), char(b, True)),
                               Span(tok(a).start, tok(b).end), ()))
    return tuple(out)
