"""A conversation per sample and arm: the agentic task's transcript asked its questions
turn by turn, each reply joining the transcript before the next question.

Each arm holds a conversation of its own: its own replies (DA tags and all, for the DA
arms) are what it reads in later turns. A DA turn is ``Engine.messages_session`` over the
chat (every earlier message, tool results and earlier replies included, is a magic
chunk); a vanilla turn is the same chat through ``render_plain_messages`` (the template's
rendering without the instruction) and a ``PlainSession``.

Each arm's conversation runs on a KV pool of its own (``Engine.with_pool``: the same
loaded model, an empty prefix cache). Inside it the prefix cache reuses every earlier
turn's prompt, as an agent loop on a server would; across arms it would hand the vanilla
arm the tool results the DA arm prefilled (the two renders agree up to the final turn),
and a turn's prefill seconds and cached tokens would measure the order the arms ran in.

A turn that cannot run (its prompt and response do not fit the model) is an error row,
and so is every later turn of that conversation: there is no reply to go on from. A
resumed run reads the replies of the turns already written from their rows and continues
the conversation where it stopped; its first new turn then prefills cold, and its row
says so (``cached_prompt_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from declattn.api import Engine, RunVanilla
from declattn.api.session import DASession, PlainSession, Session
from declattn.eval.arms import ArmRun, ArmRunner, ArmSettings
from declattn.eval.rows import build_row, error_row, row_key
from declattn.eval.sample import span_chunks
from declattn.eval.tasks.agentic import AgenticSample, tools
from declattn.protocol.messages import render_plain_messages

CONVERSATION_ARMS = ("da", "da-nm", "da-constrained", "da-model", "vanilla")


class Conversation:
    """One arm's conversation over an agentic sample, on a KV pool of its own."""

    def __init__(
        self, engine: Engine, settings: ArmSettings, sample: AgenticSample, arm: str
    ) -> None:
        if arm not in CONVERSATION_ARMS:
            raise ValueError(unsupported(arm))
        self.runner = ArmRunner(engine.with_pool(engine.pool.num_blocks), settings)
        self.sample = sample
        self.arm = arm

    def session(self, messages: list[dict[str, Any]]) -> Session:
        e, s = self.runner.engine, self.runner.settings
        if self.arm == "vanilla":
            ids = render_plain_messages(e.tokenizer, messages, tools=tools())
            return PlainSession(ids, e.block_size)
        return e.messages_session(
            messages, tools=tools(), options=self.runner.options(self.arm),
            max_tokens=s.max_tokens
        )

    def ask(self, replies: Sequence[str]) -> ArmRun:
        """The next turn, after ``replies`` (the arm's own, one per earlier turn)."""
        sess = self.session(self.sample.messages(replies))
        return self.runner.execute(self.arm, sess)


def unsupported(arm: str) -> str:
    """Why ``arm`` holds no conversation."""
    return (
        f"the agentic task runs the arms {', '.join(CONVERSATION_ARMS)}, not {arm}: a "
        "message-chunked prompt teaches focus by chunk ids only (no find arms), and the "
        "sparse arms' budget comes from one da response, not per turn"
    )


def turn_rows(
    engine: Engine,
    settings: ArmSettings,
    sample: AgenticSample,
    index: int,
    arm: str,
    *,
    model: str,
    done: Mapping[str, dict[str, Any]],
    machine: dict[str, Any],
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Each turn's row of ``arm``'s conversation, in order, with whether it was already
    written (taken from ``done``, keyed by ``row_key``); new turns run as they are asked
    for, so a caller that writes each row before asking for the next loses at most one
    turn to an interruption."""
    conversation: Conversation | None = None
    replies: list[str] = []
    stop = None if arm in CONVERSATION_ARMS else unsupported(arm)
    for turn in range(1, len(sample.turns) + 1):
        key = row_key(model, sample.task, sample.length, index, arm, turn)
        if key in done:
            row = done[key]
            if "error" in row:
                stop = stop or f"turn {turn} failed, so the conversation stops: {row['error']}"
            else:
                replies.append(row["output"]["text"])
            yield row, True
            continue
        header = sample.turn_header(turn)
        if stop is None:
            try:
                if conversation is None:
                    conversation = Conversation(engine, settings, sample, arm)
                run = conversation.ask(replies)
            except (ValueError, RunVanilla) as e:  # too long for the model, or unrenderable
                stop = f"turn {turn} failed, so the conversation stops: {e}"
                yield error_row(model, sample, index, arm, str(e), machine, turn, header), False
                continue
            replies.append(run.session.text)
            yield _row(run, sample, turn, header, model=model, index=index, machine=machine), False
        else:
            yield error_row(model, sample, index, arm, stop, machine, turn, header), False


def _row(
    run: ArmRun,
    sample: AgenticSample,
    turn: int,
    header: dict[str, Any],
    *,
    model: str,
    index: int,
    machine: dict[str, Any],
) -> dict[str, Any]:
    sess = run.session
    chunks = sess.chunks if isinstance(sess, DASession) else []
    evidence = [_fact_chunks(sess, sample, turn)] if isinstance(sess, DASession) else []
    return build_row(
        run, sample, model=model, index=index, chunks=chunks, machine=machine,
        turn=turn, header=header, evidence=evidence,
    )


def _fact_chunks(sess: DASession, sample: AgenticSample, turn: int) -> tuple[int, ...]:
    """The magic chunks holding the turn's fact: where it first occurs in the prompt,
    which is its tool result (every reply comes after every tool result)."""
    a, b = sample.turns[turn - 1].evidence
    fact = sample.context[a:b]
    at = sess.prompt.text.find(fact)
    return span_chunks(sess.chunks, at, at + len(fact)) if at >= 0 else ()
