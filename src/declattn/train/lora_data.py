"""A ``Case`` as one teacher-forced sequence of a real model: the exact prompt the engine
builds, the target replies, their labels, and the DA mask.

The prompt comes from the protocol's own renderers with the model's own settings
(``render_prompt`` for a document cut by ``segment``, ``render_messages`` for an agent
transcript), so training sees the bytes a request will see. Replies are tokenised as
one string each and must round-trip; each token's text is what the engine's
``Detokenizer`` gives for it (held-back bytes and all), and the mask is
``transcript_mask`` over those texts, with the chunk texts so find declarations resolve.

Several questions on one document: the first is the request as it runs; later ones
follow as chat turns (the question as the user turn, no instruction, as a
conversation's history renders them), with loss on the replies only. A scaffold step
reads what local reads, so each later question is written under the same rules.
Agent transcripts ask one question per sequence: a later turn of a live conversation
is a new request whose earlier replies are chunks of its own, so earlier questions go
into the transcript as messages with their target replies instead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from declattn.da.options import DAOptions
from declattn.engine.detok import Detokenizer
from declattn.protocol.find import PhraseFinder
from declattn.protocol.layout import Layout
from declattn.protocol.messages import render_messages
from declattn.protocol.prompt import render_prompt
from declattn.protocol.segment import segment, token_counter
from declattn.train.lora_tasks import Case, Question, agentic_tools
from declattn.train.mask import transcript_mask
from declattn.train.targets import reply

_REPLY = "DASENTREPLY"


@dataclass(frozen=True)
class SeqExample:
    """One sequence: ``input_ids`` (prompt, then outputs but the last), ``labels`` (-100
    where no loss), ``mask`` ``[L, L]``, and ``frozen``: the positions before the question
    window (the chunks), which training may encode without gradient."""

    input_ids: list[int]
    labels: list[int]
    mask: Tensor
    frozen: int
    layout: Layout
    kinds: tuple[str, ...]
    replies: tuple[str, ...]

    @property
    def reply_tokens(self) -> int:
        return sum(1 for t in self.labels if t != -100)


def turn_break(tokenizer: Any, question: str) -> str:
    """What the chat template puts between a reply and the next question's generation
    prompt, the question as the whole user turn."""
    messages = [
        {"role": "user", "content": "document"},
        {"role": "assistant", "content": _REPLY},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text[text.index(_REPLY) + len(_REPLY) :]


def _texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    detok = Detokenizer(tokenizer)
    return [detok.add(i) for i in ids]


def _reply_ids(tokenizer: Any, text: str) -> list[int] | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if tokenizer.decode(ids) == text else None


def encode_case(
    tokenizer: Any, case: Case, options: DAOptions, rng: random.Random, block_size: int = 16
) -> SeqExample | None:
    """The training sequence of ``case`` under ``options``; ``None`` when no question of it
    gets a target (no phrase of the question finds its evidence's chunk)."""
    if case.messages:
        return _encode_messages(tokenizer, case, options, rng, block_size)
    chunks = segment(case.context, token_counter(tokenizer), options.target, options.cap)
    texts = [c.text for c in chunks]
    finder = PhraseFinder(texts)
    asked = [(q, r) for q in case.questions if (r := reply(q, texts, finder)) is not None]
    if not asked:
        return None
    prompt = render_prompt(
        tokenizer, chunks, asked[0][0].question, sink=options.sink, style=options.style,
        instruction=options.instruction,
    )
    return _sequence(tokenizer, prompt.token_ids, prompt.layout, texts, asked, options,
                     block_size)


def _encode_messages(
    tokenizer: Any, case: Case, options: DAOptions, rng: random.Random, block_size: int
) -> SeqExample | None:
    """One question of an agent transcript, after up to all the earlier ones as turns."""
    messages = list(case.messages)
    turn = rng.randrange(len(case.questions))
    for i, q in enumerate(case.questions[: turn + 1]):
        prompt = render_messages(
            tokenizer, [*messages, {"role": "user", "content": q.question}],
            tools=agentic_tools(), target=options.target, cap=options.cap, sink=options.sink,
            instruction=options.instruction,
        )
        texts = [c.text for c in prompt.chunks]
        r = reply(q, texts, PhraseFinder(texts))
        if r is None:
            return None
        if i == turn:
            return _sequence(tokenizer, prompt.token_ids, prompt.layout, texts, [(q, r)],
                             options, block_size)
        messages += [{"role": "user", "content": q.question}, {"role": "assistant", "content": r}]
    return None


def _sequence(
    tokenizer: Any, prompt_ids: list[int], layout: Layout, chunk_texts: list[str],
    asked: Sequence[tuple[Question, str]], options: DAOptions, block_size: int,
) -> SeqExample | None:
    turns = [(q, r, ids) for q, r in asked if (ids := _reply_ids(tokenizer, r)) is not None]
    if not turns or turns[0][0] is not asked[0][0]:
        return None  # the first question is the one the prompt was rendered with
    out: list[int] = []
    learn: list[bool] = []
    texts: list[str] = []
    for i, (q, _, ids) in enumerate(turns):
        if i:
            between = tokenizer.encode(turn_break(tokenizer, q.question), add_special_tokens=False)
            out += between
            learn += [False] * len(between)
            texts += _texts(tokenizer, between)
        out += ids
        learn += [True] * len(ids)
        texts += _texts(tokenizer, ids)  # a reply starts a fresh detokenizer, as a request does
    input_ids = [*prompt_ids, *out[:-1]]
    p = layout.prompt_len
    labels = [-100] * (p - 1) + [t if k else -100 for t, k in zip(out, learn, strict=True)]
    mask = transcript_mask(
        layout, texts, block_size=block_size, chunk_texts=chunk_texts,
        line_start=options.line_start, scaffold_local=options.scaffold_local,
    )
    return SeqExample(input_ids, labels, mask, layout.question.start, layout,
                      tuple(q.kind for q, _, _ in turns), tuple(r for _, r, _ in turns))
