"""The packaged corpora cut in two: a training part and an evaluation part, never mixed.

A model trained here (``declattn train da-lora``) learns from documents of the same
corpora the evaluation draws from (essays, SQuAD and HotpotQA paragraphs), so the
corpora are split once, by a hash of each document's identity, and each side reads only
its own part: the task generators (``TaskData``, ``corpus.essays``) read the evaluation
part unless told otherwise, the training generator the training part. The rule is a
pure function of the identity, so both sides agree without a list kept anywhere.

Identities: an essay by its first paragraph (the cleaned text; essays carry no titles),
a SQuAD paragraph by its article's title (an article's paragraphs go together), a
HotpotQA paragraph by its Wikipedia title (the same title recurs across entries, and a
paragraph must not be evidence on one side and a distractor on the other). A HotpotQA
entry belongs to a part when both its supporting paragraphs do; its other paragraphs of
the other part are dropped from its context.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

Part = Literal["train", "eval", "all"]
PARTS: tuple[str, ...] = ("train", "eval", "all")
TRAIN_SHARE = 0.2
"""The share of each corpus's identities that goes to training."""


def part_of(corpus: str, identity: str) -> str:
    """``"train"`` or ``"eval"`` for one document of ``corpus`` (``essays``, ``squad``,
    ``hotpot``)."""
    digest = hashlib.sha256(f"{corpus}\0{identity}".encode()).digest()
    return "train" if int.from_bytes(digest[:8], "big") / 2**64 < TRAIN_SHARE else "eval"


def keeps(part: str, corpus: str, identity: str) -> bool:
    """Whether the ``part`` side may read this document."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, not {part!r}")
    return part == "all" or part_of(corpus, identity) == part


def essay_identity(essay: str) -> str:
    """An essay's identity: its first paragraph."""
    return essay.split("\n\n", 1)[0].strip()


def hotpot_part(entries: list[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    """The entries of ``part``: both supporting paragraphs in it, and every context
    paragraph of the other part dropped."""
    if part == "all":
        return entries
    out = []
    for e in entries:
        gold = {t for t, _ in e["supporting_facts"]}
        if not all(keeps(part, "hotpot", t) for t in gold):
            continue
        context = [[t, s] for t, s in e["context"] if keeps(part, "hotpot", t)]
        out.append({**e, "context": context})
    return out
