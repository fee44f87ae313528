"""The chat-template toolkit both prompt renderers share: render a conversation, protect
user text, tokenise it piece by piece, and check every span.

Why sentinels: user text (chunk bodies, questions, messages) must never turn into
template tokens, and its token span must be known exactly. A renderer puts a random
sentinel (``nonce``) in place of each piece of user text and renders the conversation
once (``render_chat``); ``assemble`` cuts that render at the sentinels and tokenises
template pieces with special tokens parsed (they are the template's own) and user
pieces with special-token parsing off (``encode_user_text``). The spans then come from
the piece lengths, with no search in token space, and ``verify_span`` checks that each
decodes to its text. A document full of ``<|im_end|>`` can neither inject a turn nor
shift a span.

Nothing here imports transformers or torch: the tokenizer is duck-typed (a Hugging
Face tokenizer with a chat template).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from declattn.protocol.layout import Span


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, so no DA prompt can be rendered for it."""


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise NoChatTemplateError(
            f"tokenizer {name!r} has no chat template, so a DA prompt cannot be rendered "
            "(base models usually ship none); use the tokenizer of an instruction-tuned "
            "model, or set tokenizer.chat_template to a Jinja chat template"
        )


def render_chat(
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


def nonce(user_texts: list[str]) -> str:
    """A random hex string found in no user text, so sentinels cannot collide with it."""
    while True:
        nonce = secrets.token_hex(8)
        if not any(nonce in t for t in user_texts):
            return nonce


@dataclass(frozen=True)
class Assembled:
    ids: list[int]
    text: str
    user_spans: dict[str, Span]
    boundary: int | None  # token index of the requested render offset


def special_ids(tokenizer: Any) -> frozenset[int]:
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def special_strings(tokenizer: Any) -> set[str]:
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
    special = special_ids(tokenizer) if special is None else special
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if special.isdisjoint(ids):
        return ids
    cuts = set()
    for s in special_strings(tokenizer):
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


def assemble(
    tokenizer: Any,
    render: str,
    keys: list[str],
    texts: dict[str, str],
    special: frozenset[int],
    boundary_char: int | None,
) -> Assembled:
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
    return Assembled(ids=ids, text="".join(shown), user_spans=spans, boundary=boundary)


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


def verify_span(
    tokenizer: Any, ids: list[int], span: Span, text: str, special: frozenset[int]
) -> None:
    """The span must decode to its text (or to the tokenizer's own round trip of it)."""
    piece = ids[span.start : span.end]
    if not special.isdisjoint(piece):
        raise RuntimeError(f"special token inside user text span [{span.start}, {span.end})")
    got = decode(tokenizer, piece)
    if got == text:
        return
    if got != decode(tokenizer, encode_user_text(tokenizer, text, special)):
        raise RuntimeError(f"span [{span.start}, {span.end}) does not decode to its text")


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
