"""One DA request's state machine, written once: what it has written, what it reads next.

Fed the response one token at a time, ``DAState`` keeps the tag reader (and the phrase
finder a find focus resolves against), the logits constraints, the runaway guard, and
derives from them the scope of the next decode step and the text the protocol fixes
next. The engine's DA controller (``declattn.api.session``), the vLLM plugin's tracker
and ``replay`` all drive this one class, so live, plugin and replayed figures cannot
drift apart. It imports no torch: the callers turn ids into masks and blocks.

The scope of the next step (``scope``) is the reader's mode and focus ids, except on a
*scaffold step* when ``scaffold_local`` is on. A scaffold step writes protocol text,
which needs no chunk, so it reads what ``<local>`` reads (sink, question window and
response). A step is a scaffold step exactly when, before it, either

- a tag candidate is pending (``TagReader.pending``: text from a ``<`` that may still
  become a tag, such as ``<focus find="lake`` or ``</fo``), or
- the response so far, with trailing whitespace removed, is empty or ends with a closing
  tag (``</focus>``, ``</global>``, ``</local>``, ``</answer>``): the point between two
  blocks, where the protocol expects the next tag.

So the words of a find tag are written from the question, not the chunks; the first
token after a block boundary that turns out to be prose (no tag) is the one step that
reads less than its mode would. Replay applies the same rule from the same class, and
the training mask builder uses replay, so all three agree row by row.

The fixed text (``forced_text``) is ``<`` before a reply that must open with a tag, and
the rest of a tag once the pending text can only become one tag the current mode
allows: ``</fo`` in a focus can only be ``</focus>``, ``<focus find="lake shore"`` can
only be closed by ``>``, ``<ans`` only ``<answer>``. With ``close_at_one_chunk``
(``DAOptions.close_find_at_one_chunk``) a find phrase is closed (``">``) as soon as it
names one chunk for good (``constrain_find.closing_at_one_chunk``).
With ``answer_vocab`` (``DAOptions.answer_after_find``) the answer follows a find focus at
once: right after ``<focus find="...">`` the fixed text is the rest of ``<answer>``
(``due_answer``), and a constraint holds a caller that samples it to that text.
A caller may append it in one forward (jump-forward) instead of one decode step a token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from declattn.da.constrain import FocusConstraint, FocusVocab, TokenConstraint
from declattn.da.constrain_find import FindConstraint, FindVocab, closing_at_one_chunk
from declattn.da.constrain_open import (
    ANSWER_TAG,
    AnswerNextConstraint,
    OpeningConstraint,
    OpeningVocab,
)
from declattn.da.runaway import RunawayGuard
from declattn.da.scope import Scope
from declattn.protocol.find import PhraseFinder
from declattn.protocol.layout import Layout
from declattn.protocol.modes import Mode
from declattn.protocol.tags import Declaration, TagReader

FIND_HEAD = '<focus find="'
IDS_HEAD = '<focus magic_chunks="'
HEADS = {"ids": (IDS_HEAD,), "find": (FIND_HEAD,), "both": (FIND_HEAD, IDS_HEAD)}
"""The opening of a focus tag the request's focus form teaches, fixed once the model has
written enough of it to tell which."""

_ANY_MODE_TAGS = ("<answer>",)
_MODE_TAGS: dict[Mode, tuple[str, ...]] = {
    Mode.GLOBAL: ("</global>", "<local>"),
    Mode.FOCUS: ("</focus>",),
    Mode.LOCAL: ("</local>",),
    Mode.ANSWER: ("</answer>",),
}
_ATTR_CLOSED = re.compile(r"<focus[ \t]+(?:find|magic_chunks)[ \t]*=[ \t]*\"[^\"<>]*\"\Z")
MIN_FORCED_PENDING = 2
"""A lone ``<`` fixes nothing: in an answer or prose it may be a less-than sign."""


def fixed_continuation(pending: str, mode: Mode, heads: Sequence[str] = ()) -> str | None:
    """The text that must follow ``pending`` (the reader's undecided tail) for it to
    become the one tag it can still become in ``mode``; ``None`` when it could become
    several, none, or is too short to tell.

    The tags a mode allows: in global ``</global>``, ``<local>``, ``<answer>`` and the
    focus ``heads``; in a focus ``</focus>`` and ``<answer>``; in local ``</local>`` and
    ``<answer>``; in an answer ``</answer>``. A focus head once its attribute's value is
    closed (``<focus find="..."``) can only be followed by ``>``."""
    if len(pending) < MIN_FORCED_PENDING:
        return None
    if mode is Mode.GLOBAL and _ATTR_CLOSED.match(pending):
        return ">"
    tags = _MODE_TAGS[mode] + (() if mode is Mode.ANSWER else _ANY_MODE_TAGS)
    if mode is Mode.GLOBAL:
        tags = tags + tuple(heads)
    fits = [t for t in tags if t.startswith(pending) and len(t) > len(pending)]
    return fits[0][len(pending):] if len(fits) == 1 else None


class DAState:
    """The DA state of one response: fed its tokens' text, it says what to read next.

    ``chunk_texts`` lets find focus resolve (without them every find is declined);
    ``focus_vocab`` / ``find_vocab`` turn on the matching logits constraint;
    ``focus_form`` (``ids``, ``find``, ``both``) is what the instruction taught, for the
    fixed text of a focus head; ``opening_vocab``, where given, makes the response open
    with a tag (that focus head, ``<global>``, ``<local>`` or ``<answer>``);
    ``answer_vocab``, where given, makes ``<answer>`` follow a find focus;
    ``close_at_one_chunk`` fixes the close of a find phrase that names one chunk; ``runaway``
    stops a looping response; ``end_ids`` (the tokenizer's special tokens) may not end the
    response before an ``<answer>`` is open.
    """

    def __init__(
        self,
        layout: Layout,
        chunk_texts: Sequence[str] | None = None,
        *,
        line_start: bool = False,
        scaffold_local: bool = False,
        focus_form: str = "ids",
        focus_vocab: FocusVocab | None = None,
        find_vocab: FindVocab | None = None,
        opening_vocab: OpeningVocab | None = None,
        answer_vocab: OpeningVocab | None = None,
        close_at_one_chunk: bool = False,
        runaway: RunawayGuard | None = None,
        end_ids: Sequence[int] = (),
    ) -> None:
        if chunk_texts is not None and len(chunk_texts) != layout.n_chunks:
            raise ValueError(
                f"{len(chunk_texts)} chunk texts for a layout of {layout.n_chunks} chunks"
            )
        self.layout = layout
        self.finder = PhraseFinder(list(chunk_texts)) if chunk_texts is not None else None
        self.reader = TagReader(layout.n_chunks, line_start=line_start, finder=self.finder)
        self.scaffold_local = scaffold_local
        self.heads = HEADS[focus_form]
        self.constraints: list[TokenConstraint] = []
        if focus_vocab is not None:
            self.constraints.append(FocusConstraint(focus_vocab, layout.n_chunks))
        if find_vocab is not None and self.finder is not None:
            find = FindConstraint(find_vocab, self.finder, close_at_one_chunk=close_at_one_chunk)
            find.prepare()  # its index is built now, not on the first step inside a tag
            self.constraints.append(find)
        self.opening = None
        self.opens_alone = opening_vocab is not None and opening_vocab.opens_alone
        if opening_vocab is not None:
            self.opening = OpeningConstraint(opening_vocab.ids_for(self.heads))
            self.constraints.append(self.opening)
        self.answer_after_find = answer_vocab is not None
        if answer_vocab is not None:
            self.constraints.append(AnswerNextConstraint(answer_vocab, self.due_answer))
        self.close_at_one_chunk = close_at_one_chunk
        self.runaway = runaway
        self.end_ids = tuple(end_ids)
        self.text = ""
        self.n_tokens = 0
        self._boundary = 0  # where the last closing tag ended (the response's start at first)

    def feed(self, token_id: int, text: str) -> str | None:
        """Read one token's text; a returned reason finishes the response (``answer``
        at an accepted ``</answer>``, or the runaway guard's)."""
        self.text += text
        self.n_tokens += 1
        if self.opening is not None:
            self.opening.written = True
        done = None
        for d in self.reader.feed(text):
            if d.kind.startswith("/"):
                self._boundary = d.end
            if d.kind == "/answer" and d.accepted:
                done = "answer"
        if done is None and self.runaway is not None:
            done = self.runaway.on_token(token_id, text, self.answer_open())
        return done

    def finish(self) -> None:
        """End of the response: a dangling tag candidate is plain text."""
        if not self.reader.finished:
            self.reader.finish()

    @property
    def at_scaffold(self) -> bool:
        """Whether the next step writes protocol text (see the module docstring)."""
        return bool(self.reader.pending) or not self.text[self._boundary :].strip()

    def scope(self) -> Scope:
        """What the next decode step reads."""
        if self.scaffold_local and self.at_scaffold:
            return Scope(self.layout, Mode.LOCAL)
        return Scope(self.layout, self.reader.mode, self.reader.focus_ids)

    def forced_text(self) -> str | None:
        """The text the protocol fixes next: ``<`` before a reply that must open with a
        tag (every tag starts with it; where the tokenizer writes it as a token of its
        own, ``OpeningVocab.opens_alone``), the rest of a due ``<answer>``, the close of
        a find phrase that names one chunk (``close_at_one_chunk``), else
        ``fixed_continuation`` of the pending tag."""
        if self.opens_alone and self.opening is not None and not self.opening.written:
            return "<"
        due = self.due_answer()
        if due is not None:
            return due
        if self.close_at_one_chunk and self.finder is not None and self.reader.mode is Mode.GLOBAL:
            close = closing_at_one_chunk(self.reader.pending, self.finder)
            if close is not None:
                return close
        return fixed_continuation(self.reader.pending, self.reader.mode, self.heads)

    def due_answer(self) -> str | None:
        """The rest of ``<answer>`` when it must come next: ``answer_after_find`` is on,
        the newest declaration is an accepted find focus, and what follows its tag
        (leading whitespace aside) is still a start of ``<answer>``."""
        if not self.answer_after_find or self.reader.mode is not Mode.FOCUS:
            return None
        last = self.reader.declarations[-1] if self.reader.declarations else None
        if last is None or last.kind != "focus" or last.phrase is None or not last.accepted:
            return None
        after = self.text[last.end :].lstrip()
        if len(after) < len(ANSWER_TAG) and ANSWER_TAG.startswith(after):
            return ANSWER_TAG[len(after) :]
        return None

    def banned_ids(self) -> tuple[int, ...]:
        """Token ids the next token may not be: the end of the response (``end_ids``)
        once a tag is written and until an answer is opened, so a reply that found its
        fact in a focus goes on to write the answer instead of stopping without one. A
        reply that has declared nothing is a plain answer and may end: holding it open
        only makes it ramble until the runaway guard stops it."""
        if not self.reader.declarations or self.answer_open():
            return ()
        return self.end_ids

    def answer_open(self) -> bool:
        """Whether ``<answer>`` has been written (or is being written)."""
        if any(d.kind == "answer" and d.accepted for d in self.reader.declarations):
            return True
        pending = self.reader.pending
        return bool(pending) and (pending.startswith("<answer") or "<answer".startswith(pending))

    @property
    def mode(self) -> Mode:
        return self.reader.mode

    @property
    def focus_ids(self) -> tuple[int, ...]:
        return self.reader.focus_ids

    @property
    def declarations(self) -> tuple[Declaration, ...]:
        return self.reader.declarations

    @property
    def declines(self) -> tuple[Declaration, ...]:
        return self.reader.declines
