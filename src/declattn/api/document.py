"""One context, many questions: ``Document.ask`` for independent questions, ``Chat`` for
a conversation whose turns accumulate. Both ride on the engine's prefix cache: the
document renders first and the questions after it, so its prefill is paid once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from declattn.api.results import Answer, Delta
from declattn.api.session import Session
from declattn.da.options import DAOptions
from declattn.engine.sampler import SamplingParams
from declattn.protocol.segment import Chunk, segment, token_counter


class Asker(Protocol):
    """What a document needs of the engine (``declattn.Engine`` is one): its tokenizer,
    its DA defaults, a session per question, and a stream that runs one."""

    tokenizer: Any

    def da_options(self, options: DAOptions | None = None) -> DAOptions: ...

    def session(
        self, context: str, question: str, *, da: bool = True, options: DAOptions | None = None,
        max_tokens: int | None = None, history: Sequence[tuple[str, str]] = (),
        chunks: Sequence[Chunk] | None = None, shared_prefix: bool = False,
    ) -> Session: ...

    def stream(
        self, sess: Session, params: SamplingParams,
        on_prefill: Callable[[int, int], None] | None = None,
        result: list[Answer] | None = None,
    ) -> Iterator[Delta]: ...


def _drain(stream: Iterator[Delta]) -> None:
    for _ in stream:
        pass


class Document:
    """One context asked many questions (``ask``), or talked over turn by turn (``chat``).

    The context is cut into magic chunks once; every question renders the same prompt
    up to its own turn (document first, question last), so the engine's prefix cache
    prefills the document once and each later question pays only for its own tail.
    """

    def __init__(self, engine: Asker, context: str, options: DAOptions | None = None) -> None:
        if not context.strip():
            raise ValueError("the context is empty")
        self.engine = engine
        self.context = context
        self.options = engine.da_options(options)
        o = self.options
        self.chunks = segment(context, token_counter(engine.tokenizer), o.target, o.cap)

    def session(
        self,
        question: str,
        *,
        da: bool = True,
        masking: bool = True,
        max_tokens: int | None = None,
        history: Sequence[tuple[str, str]] = (),
    ) -> Session:
        """The session of one question (``masking=False``: DA-nm). A plain question
        (``da=False``) is asked over the same chunk transcript, so it shares the
        document's prefill (``Engine.session``'s ``shared_prefix``)."""
        options = dataclasses.replace(self.options, masking=masking)
        return self.engine.session(
            self.context, question, da=da, options=options, max_tokens=max_tokens,
            history=history, chunks=self.chunks, shared_prefix=not da,
        )

    def generate(
        self,
        question: str,
        *,
        da: bool = True,
        masking: bool = True,
        max_tokens: int = 512,
        params: SamplingParams | None = None,
        history: Sequence[tuple[str, str]] = (),
        on_prefill: Callable[[int, int], None] | None = None,
        result: list[Answer] | None = None,
    ) -> Iterator[Delta]:
        """Stream the answer to ``question`` (after ``history`` turns, if any)."""
        params = params or SamplingParams(max_tokens=max_tokens)
        sess = self.session(
            question, da=da, masking=masking, max_tokens=params.max_tokens, history=history
        )
        return self.engine.stream(sess, params, on_prefill, result)

    def ask(self, question: str, **kwargs: Any) -> Answer:
        """Answer ``question`` over the document on its own (no earlier turns);
        ``kwargs`` as ``generate``."""
        out: list[Answer] = []
        _drain(self.generate(question, result=out, **kwargs))
        return out[0]

    def chat(self) -> Chat:
        """A conversation over the document: each answer is a turn the next one reads."""
        return Chat(self)


class Chat:
    """Turns over one ``Document``: every earlier question and reply stays in the prompt
    (read in every mode, like the response), and each turn's prompt extends the last
    one's, so the prefix cache reuses all of it but the newest turn."""

    def __init__(self, document: Document) -> None:
        self.document = document
        self.turns: list[tuple[str, str]] = []

    def generate(self, question: str, **kwargs: Any) -> Iterator[Delta]:
        """Stream the reply to ``question``; it joins the conversation when it ends."""
        out: list[Answer] | None = kwargs.pop("result", None)
        if out is None:
            out = []
        yield from self.document.generate(
            question, history=tuple(self.turns), result=out, **kwargs
        )
        self.turns.append((question, out[-1].text))

    def ask(self, question: str, **kwargs: Any) -> Answer:
        out: list[Answer] = []
        _drain(self.generate(question, result=out, **kwargs))
        return out[0]

