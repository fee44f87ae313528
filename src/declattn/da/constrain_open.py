"""Tags the economical protocol fixes: the reply opens with one, and the answer follows a
find focus at once.

A zero-shot model asked for the economical reply sometimes answers in prose from the
first token, declares nothing, and so reads the whole context for every token of a reply
longer than the plain one, and is scored wrong for lacking ``<answer>`` (docs/eval.md,
"The per-answer study"). With this constraint (``DAOptions.open_tag``) the first token
must begin one of the tags the protocol opens a reply with: the focus head the
instruction teaches, ``<global>``, ``<local>`` or ``<answer>``. The model still chooses
which; the rest of the tag is the other constraints' and the fixed text's business.
``<answer>`` first is a plain answer inside tags, read in global.

After a find focus (``DAOptions.answer_after_find``), ``AnswerNextConstraint`` lets only
the rest of ``<answer>`` come next: the instruction teaches
``<focus find="WORDS"><answer>X</answer>``, and a zero-shot model that copies the fact
inside the focus first (a 7-digit number written twice, ~13 forwards) or wanders there
pays decode steps for nothing. The
model still writes the answer; a question that needs two facts opens with ``<global>``.
With jump-forward the fixed ``<answer>`` goes in one forward (``DAState.forced_text``);
without it (vLLM) this constraint makes the model write it token by token.

Torch-free, like ``constrain.py``: it gives ids; ``declattn.api.constrained`` masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from declattn.da.constrain import ConstraintStats, token_texts

ANSWER_TAG = "<answer>"
OPENINGS = ("<global>", "<local>", ANSWER_TAG)
"""The tags besides the focus heads a reply may open with."""


@dataclass(frozen=True)
class OpeningVocab:
    """The tokens that can begin a tag (``texts``: written first, their text starts with
    ``<``) or write on a fixed ``<answer>`` (``inner``: written mid-reply, their text is
    part of it): a few hundred of a vocabulary. Built once per tokenizer."""

    texts: Mapping[int, str]
    inner: Mapping[int, str] = field(default_factory=dict)
    opens_alone: bool = False
    """The tokenizer writes ``<`` as a token of its own at the start of every tag, so a
    reply that must open with a tag has ``<`` as fixed text (``DAState.forced_text``)."""

    @classmethod
    def from_texts(
        cls, texts: Mapping[int, str], inner: Mapping[int, str] | None = None
    ) -> OpeningVocab:
        """From each token's text as written at the start of a reply (``texts``) and
        after ``<`` mid-reply (``inner``, default ``texts``: a SentencePiece token reads
        differently in the two places)."""
        mid = texts if inner is None else inner
        return cls(
            {i: t for i, t in sorted(texts.items()) if t.startswith("<")},
            {i: t for i, t in sorted(mid.items()) if t and t in ANSWER_TAG},
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> OpeningVocab:
        vocab = cls.from_texts(token_texts(tokenizer, ""), token_texts(tokenizer, "<"))
        return dataclasses.replace(vocab, opens_alone=opens_alone(tokenizer))

    def ids_for(self, heads: Sequence[str]) -> tuple[int, ...]:
        """Token ids whose text is the start of (or the whole of) an opening tag: one of
        ``OPENINGS`` or a focus head in ``heads``."""
        tags = (*heads, *OPENINGS)
        return tuple(i for i, t in self.texts.items() if any(tag.startswith(t) for tag in tags))

    def ids_within(self, rest: str) -> tuple[int, ...]:
        """Token ids whose text, written mid-reply, is a start of ``rest`` (a part of
        ``<answer>``)."""
        return tuple(i for i, t in self.inner.items() if rest.startswith(t))


def opens_alone(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` writes every opening tag with ``<`` as its first token, alone
    (Qwen's, SmolLM2's, Gemma's; not a vocabulary with each tag a token of its own)."""
    firsts = [tokenizer.encode(t, add_special_tokens=False)[:1] for t in ("<focus", *OPENINGS)]
    return all(ids and tokenizer.decode(ids) == "<" for ids in firsts)


class OpeningConstraint:
    """Restricts the response's first token to ``ids``; off once a token is written."""

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("no token of this tokenizer can begin a tag")
        self.ids = np.asarray(ids, dtype=np.int64)
        self.stats = ConstraintStats()
        self.written = False

    def allowed_ids(self, pending: str) -> np.ndarray | None:
        """The opening ids before the first token; None after it."""
        return None if self.written else self.ids


class AnswerNextConstraint:
    """Restricts the next token to a start of ``due()`` (the rest of ``<answer>`` after a
    find focus, ``DAState.due_answer``) while it is not ``None``."""

    def __init__(self, vocab: OpeningVocab, due: Callable[[], str | None]) -> None:
        self.vocab = vocab
        self.due = due
        self.stats = ConstraintStats()
        self._ids: dict[str, np.ndarray] = {}

    def allowed_ids(self, pending: str) -> np.ndarray | None:
        """The tokens that write on the fixed ``<answer>``; None where nothing is fixed."""
        rest = self.due()
        if not rest:
            return None
        if rest not in self._ids:
            self._ids[rest] = np.asarray(self.vocab.ids_within(rest), dtype=np.int64)
        return self._ids[rest]
