"""Episodes as training examples: the prompt the engine would build, the target tokens,
and the mask, for any tokenizer with a chat template (the tiny word-level one or a real
model's).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from declattn.da.options import DAOptions
from declattn.da.scope import DEFAULT_BLOCK_SIZE
from declattn.protocol.instruction import BRIEF_INSTRUCTION, final_turn
from declattn.protocol.layout import Layout
from declattn.protocol.prompt import render_prompt
from declattn.protocol.segment import Chunk, segment, token_counter
from declattn.train.mask import transcript_mask
from declattn.train.tasks import CHUNK_TOKENS, Episode, make_episode
from declattn.train.vocab import build_tokenizer, words_of

DA_TINY_SINK = 4


def da_tiny_options() -> DAOptions:
    """The DA settings a model trained here is served with (its ``declattn.json``).

    ``min_context=0``: the model is trained for DA replies only (it never learnt a plain
    answer), so there is no plain reply for the gate to weigh DA against."""
    return DAOptions(
        target=CHUNK_TOKENS, cap=CHUNK_TOKENS, sink=DA_TINY_SINK, style="inline",
        instruction=BRIEF_INSTRUCTION, min_context=0,
    )


@dataclass(frozen=True)
class Example:
    """One teacher-forced sequence: inputs, the targets of its output rows, its mask."""

    input_ids: list[int]
    labels: list[int]  # -100 on prompt rows that predict prompt tokens
    mask: Tensor  # [L, L] bool
    layout: Layout
    output_texts: tuple[str, ...]

    @property
    def regions(self) -> list[int]:
        """Each input position's region (``Layout.regions``), for models that need it."""
        return self.layout.regions(0, len(self.input_ids))


def encode(
    tokenizer: Any,
    episodes: Episode | Sequence[Episode],
    options: DAOptions,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    masking: bool = True,
    chunk_local: bool = False,
    paragraph_chunks: bool = False,
) -> Example:
    """Render the first episode exactly as ``DASession`` would and mask it by the scope
    rules; further episodes (questions on the same document) follow as new turns.

    The segmenter cuts the document, as at run time, and must give back its paragraphs
    (the target names their ids). ``paragraph_chunks`` takes the paragraphs as the
    chunks directly instead, for a tokenizer the chunk size was not tuned for.

    Later turns read the document through the same scope rules (their questions and
    replies sit in the response, which every mode keeps), so they are more lookups to
    learn from per sequence; only the replies carry loss, and the first turn is exactly
    what the model sees at run time.
    """
    eps = [episodes] if isinstance(episodes, Episode) else list(episodes)
    first = eps[0]
    if paragraph_chunks:
        chunks = paragraph_chunks_of(first)
    else:
        chunks = segment(first.context, token_counter(tokenizer), options.target, options.cap)
    if len(chunks) != len(first.paragraphs):
        raise ValueError(
            f"the segmenter made {len(chunks)} chunks of {len(first.paragraphs)} paragraphs; "
            "the chunk size does not fit this tokenizer"
        )
    prompt = render_prompt(
        tokenizer, chunks, first.question, sink=options.sink, style=options.style,
        instruction=options.instruction,
    )
    out_ids: list[int] = []
    learn: list[bool] = []
    for i, e in enumerate(eps):
        if i:
            between = _turn_break(tokenizer, e.question, options)
            turn = tokenizer.encode(between, add_special_tokens=False)
            out_ids += turn
            learn += [False] * len(turn)
        reply = tokenizer.encode(e.target, add_special_tokens=False)
        if tokenizer.decode(reply) != e.target:
            raise ValueError("the target transcript does not round-trip through the tokenizer")
        out_ids += reply
        learn += [True] * len(reply)
    texts = tuple(tokenizer.decode([i]) for i in out_ids)
    ids = [*prompt.token_ids, *out_ids[:-1]]
    p = prompt.layout.prompt_len
    labels = [-100] * (p - 1) + [t if k else -100 for t, k in zip(out_ids, learn, strict=True)]
    mask = transcript_mask(
        prompt.layout, texts, block_size=block_size, masking=masking, chunk_local=chunk_local
    )
    return Example(ids, labels, mask, prompt.layout, texts)


_REPLY = "DASENTREPLY"


def _turn_break(tokenizer: Any, question: str, options: DAOptions) -> str:
    """What the chat template puts between one reply and the next generation prompt."""
    messages = [
        {"role": "user", "content": "document"},
        {"role": "assistant", "content": _REPLY},
        {"role": "user", "content": final_turn(question, options.instruction)},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text[text.index(_REPLY) + len(_REPLY) :]


def paragraph_chunks_of(episode: Episode) -> list[Chunk]:
    """One chunk per paragraph, the separators going with the paragraph before them."""
    out, at = [], 0
    for i, text in enumerate(episode.paragraphs, 1):
        sep = "\n\n" if i < len(episode.paragraphs) else ""
        out.append(Chunk(i, at, at + len(text) + len(sep), text + sep, 0))
        at += len(text) + len(sep)
    return out


def tiny_tokenizer(max_chunks: int = 64, seed: int = 0) -> Any:
    """The word-level tokenizer of ``da-tiny``, as a ``transformers`` fast tokenizer.

    Its vocabulary is every word of the generated tasks (all entities, numbers, filler)
    plus every word of the DA prompt scaffold, read off real renders: a provisional
    tokenizer renders prompts for every chunk count, and the scaffold's words join it.
    """
    rng = random.Random(seed)
    episodes = [make_episode(rng, n, n > 1) for n in range(1, max_chunks + 1)]
    words = words_of(_task_texts(episodes, max_chunks))
    provisional = _as_hf(build_tokenizer(words))
    options = da_tiny_options()
    renders = [
        render_prompt(
            provisional,
            segment(e.context, token_counter(provisional), options.target, options.cap),
            e.question, sink=options.sink, style=options.style, instruction=options.instruction,
        ).text
        for e in episodes
    ]
    return _as_hf(build_tokenizer(words | words_of(renders)))


def _task_texts(episodes: Iterable[Episode], max_chunks: int) -> list[str]:
    from declattn.train.tasks import FILLER, N_ENTITIES, ONE_HOP, TWO_HOP, entity

    names = [entity(i) for i in range(N_ENTITIES)]
    numbers = [str(i) for i in range(max_chunks + 1)]
    words = [*names, *numbers, *FILLER, "."]
    return [
        " ".join(words),  # each with a leading space ...
        "\n".join(words),  # ... and without

        ONE_HOP,
        TWO_HOP,
        *(e.target for e in episodes),
        *(e.context for e in episodes),
    ]


def _as_hf(tok: Any) -> Any:
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from declattn.train.vocab import save_tokenizer

    with tempfile.TemporaryDirectory() as d:
        save_tokenizer(tok, Path(d))
        return AutoTokenizer.from_pretrained(d)
