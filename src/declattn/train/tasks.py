"""Synthetic DA training tasks: numbered chunks of filler holding key -> value facts.

A document is N paragraphs, one per magic chunk, each with two facts ``eA eB .`` (entity
A leads to entity B) among filler words. A question asks where one entity leads
(1-hop) or where it leads after two steps (2-hop, the second fact in another chunk).
The target transcript is what a model that declares should write: name the key in
global (the step that writes the focus tag still reads everything, and picks the chunk),
focus on that chunk and copy the fact, and answer from the copy::

    <global> e17</global><focus magic_chunks="5"> e17 e201</focus><answer> e201</answer>

(2-hop repeats the global/focus pair for the second fact). Every entity in a document
is distinct except the 2-hop link, so each question has one answer and one evidence
chunk per hop. The chunk count varies per example, so the model never learns a fixed
count. Blocks follow each other without a newline: text between blocks is decoded in
global, and a tiny model's reply is short enough for those steps to matter. Paragraph
sizes are chosen so that the segmenter, run with ``CHUNK_TOKENS``,
cuts the document back into exactly these paragraphs: the model trains on the same
prompts ``Engine.answer`` builds at run time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

N_ENTITIES = 512
CHUNK_TOKENS = 16
"""Segmenter target and cap for documents made here: one paragraph (9-15 word tokens and
its separator) fits, two never do."""

FILLER = (
    "the old quiet red blue small green dark warm cold soft loud slow fast "
    "bright plain round tall thin wide calm wild deep high low near far long short"
).split()

ONE_HOP = "What does {key} lead to ?"
TWO_HOP = "What does {key} lead to after two steps ?"


@dataclass(frozen=True)
class Fact:
    key: str
    value: str
    chunk: int  # 1-based


@dataclass(frozen=True)
class Episode:
    """One document, one question, and the transcript a declaring model should write."""

    paragraphs: tuple[str, ...]
    question: str
    target: str
    answer: str
    hops: tuple[Fact, ...]  # the facts the answer needs, in order

    @property
    def context(self) -> str:
        return "\n\n".join(self.paragraphs)

    @property
    def evidence_chunks(self) -> tuple[int, ...]:
        return tuple(f.chunk for f in self.hops)


def entity(i: int) -> str:
    return f"e{i}"


def _paragraph(rng: random.Random, facts: list[Fact]) -> str:
    """Filler around the facts: 3 to 8 filler words, so 9 to 14 word tokens in all.

    A paragraph never starts with a fact, so every entity is the same token (with its
    leading space) in the document, the question and the reply: in a word-level
    vocabulary ``e17`` and `` e17`` are unrelated tokens, and a tiny model cannot learn
    to copy one as the other for hundreds of entities.
    """
    words = [rng.choice(FILLER) for _ in range(rng.randint(3, 8))]
    slots = sorted(rng.sample(range(1, len(words) + 1), len(facts)))
    for fact, at in reversed(list(zip(facts, slots, strict=True))):
        words[at:at] = [fact.key, fact.value, "."]
    return " ".join(words)


def make_episode(rng: random.Random, n_chunks: int, two_hop: bool) -> Episode:
    """A seeded document of ``n_chunks`` paragraphs and one question about it."""
    return make_episodes(rng, n_chunks, [two_hop])[0]


def make_episodes(rng: random.Random, n_chunks: int, kinds: Sequence[bool]) -> list[Episode]:
    """One document and up to ``len(kinds)`` questions on it (``True``: 2-hop).

    Training asks several questions per document (one sequence, several lookups to
    learn from); each question uses facts no earlier one used, so stops early when the
    document runs out of them.
    """
    if not kinds:
        raise ValueError("ask at least one question")
    if n_chunks < (2 if kinds[0] else 1):
        raise ValueError(f"{'2' if kinds[0] else '1'}-hop needs more than {n_chunks} chunk(s)")
    if 4 * n_chunks > N_ENTITIES:
        raise ValueError(f"at most {N_ENTITIES // 4} chunks (entities run out)")
    names = [entity(i) for i in rng.sample(range(N_ENTITIES), 4 * n_chunks)]
    facts = [Fact(names[2 * i], names[2 * i + 1], i // 2 + 1) for i in range(2 * n_chunks)]
    free = list(range(len(facts)))
    chains: list[list[int]] = []
    for two_hop in kinds:
        if not free:
            break
        first = free.pop(rng.randrange(len(free)))
        chain = [first]
        others = [i for i in free if facts[i].chunk != facts[first].chunk]
        if two_hop and others:
            second = rng.choice(others)
            free.remove(second)
            facts[second] = Fact(facts[first].value, facts[second].value, facts[second].chunk)
            chain.append(second)
        chains.append(chain)
    paragraphs = tuple(
        _paragraph(rng, [f for f in facts if f.chunk == c]) for c in range(1, n_chunks + 1)
    )
    return [_episode(paragraphs, tuple(facts[i] for i in chain)) for chain in chains]


def _episode(paragraphs: tuple[str, ...], hops: tuple[Fact, ...]) -> Episode:
    question = (TWO_HOP if len(hops) == 2 else ONE_HOP).format(key=hops[0].key)
    blocks = [
        f'<global> {f.key}</global><focus magic_chunks="{f.chunk}"> {f.key} {f.value}</focus>'
        for f in hops
    ]
    answer = hops[-1].value
    target = "".join(blocks) + f"<answer> {answer}</answer>"
    return Episode(paragraphs, question, target, answer, hops)


def wrong_chunk(episode: Episode, rng: random.Random, n_chunks: int) -> int:
    """A chunk that holds none of the episode's evidence (for the forced-wrong control)."""
    bad = set(episode.evidence_chunks)
    return rng.choice([c for c in range(1, n_chunks + 1) if c not in bad])
