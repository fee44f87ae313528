"""The agentic task: an agent reads files with a tool, then the user asks about them,
one question per turn, and every reply joins the transcript before the next question.

The transcript: a system turn, the user's request naming the files, then for each file
an assistant ``read_file`` call and its tool result (a few thousand tokens of essay prose
with invented facts planted, ``corpus.planted_document``), and the agent saying it has
read them. ``TURNS`` questions follow, each answered by one planted fact; the order of
the questions is independent of the order of the files, so a reply has to look back
past the other files and the earlier turns. This is the regime DA is built for: the
tool results are the natural magic chunks, and a transcript that only grows is
prefilled once (the engine's prefix cache) and decoded many times.

The files' texts, joined, are the sample's ``context`` (so its sha256 proves that a
resumed run regenerated the same files); each turn's evidence is its fact's span in it.
Every answer appears, case-insensitively, in exactly one tool result: a fact whose
answer the prose or another fact happens to contain is drawn again.

``length`` sizes the transcript at the first question (its messages' text plus role
headers, in tokens of the served tokenizer); files are about ``FILE_TOKENS`` each, at
least two, so the 16K transcript holds nine files and the 2K one two.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from declattn.corpora.build import TaskData
from declattn.corpora.essays import PlantedDoc, planted_document, planted_fact
from declattn.eval.sample import Sample

TASK = "agentic"
FAMILY = "agentic"
TURNS = 4
"""Questions per conversation, one per turn."""
FILE_TOKENS = 2000
"""About one magic chunk per file at the default chunk size (2,048)."""
MIN_LENGTH = 1024
MESSAGE_TOKENS = 5
"""What a chat template adds around one message (role header, end of turn), about."""
TOOL = "read_file"
SYSTEM = (
    "You are a research assistant working in the user's project folder. Read files with "
    f"the {TOOL} tool and answer the user's questions from what the files say."
)
_TOPICS = (
    "harbour", "lighthouse", "ferries", "archive", "gardens", "weather", "mill", "school",
    "market", "chapel", "signals", "boathouse", "library", "bakery", "quarry", "orchard",
)
_DRAWS = 200
"""Redraws of one fact before the generator gives up (none is needed in practice)."""


def tools() -> list[dict[str, Any]]:
    """The tool definitions the transcript is rendered with (OpenAI's format)."""
    return [
        {
            "type": "function",
            "function": {
                "name": TOOL,
                "description": "Read a text file from the project folder.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "file path"}},
                    "required": ["path"],
                },
            },
        }
    ]


@dataclass(frozen=True)
class ToolFile:
    """One file the agent read: its path and its text's span in the sample's context."""

    path: str
    start: int
    end: int


@dataclass(frozen=True)
class Turn:
    """One question: its expected answer, the file holding it, and the fact's span in
    the sample's context."""

    question: str
    answers: tuple[str, ...]
    file: int
    evidence: tuple[int, int]


@dataclass(frozen=True)
class AgenticSample(Sample):
    """A sample that is a conversation: ``turns`` questions over the tool results.

    ``question`` and ``answers`` are the first turn's (what a single-response view of
    the sample would ask); ``turn_header`` gives each turn's own, for its row.
    """

    request: str = ""
    files: tuple[ToolFile, ...] = ()
    turns: tuple[Turn, ...] = ()

    def file_text(self, i: int) -> str:
        f = self.files[i]
        return self.context[f.start : f.end]

    def transcript(self) -> list[dict[str, Any]]:
        """The messages before the first question: request, tool calls and results."""
        out: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": self.request},
        ]
        for i, f in enumerate(self.files):
            call_id = f"call_{i + 1}"
            call = {"name": TOOL, "arguments": json.dumps({"path": f.path})}
            out.append(
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": call_id, "type": "function", "function": call}]}
            )
            out.append(
                {"role": "tool", "tool_call_id": call_id, "name": TOOL,
                 "content": self.file_text(i)}
            )
        out.append({"role": "assistant", "content": _done(len(self.files))})
        return out

    def messages(self, replies: Sequence[str]) -> list[dict[str, Any]]:
        """The conversation when turn ``len(replies) + 1`` is asked: the transcript, each
        earlier question with its reply (as the model wrote it), then the question."""
        if len(replies) >= len(self.turns):
            raise ValueError(f"{len(replies)} replies: the conversation has only "
                             f"{len(self.turns)} turns")
        out = self.transcript()
        for turn, reply in zip(self.turns, replies, strict=False):
            out += [{"role": "user", "content": turn.question},
                    {"role": "assistant", "content": reply}]
        out.append({"role": "user", "content": self.turns[len(replies)].question})
        return out

    def turn_header(self, turn: int) -> dict[str, Any]:
        """The header of turn ``turn`` (from 1): the sample's, with that turn's question,
        answers and evidence, so scoring and the judge read the turn's own."""
        t = self.turns[turn - 1]
        return {
            **self.header(),
            "turn": turn,
            "question": t.question,
            "answers": list(t.answers),
            "evidence": [list(t.evidence)],
        }


def _done(n: int) -> str:
    return f"I have read all {n} files. What would you like to know?"


def _request(paths: Sequence[str]) -> str:
    return (
        "I am writing a briefing from the notes in this folder: " + ", ".join(paths)
        + ". Please read each file, then answer my questions from what the files say."
    )


def _paths(rng: random.Random, n: int) -> list[str]:
    topics = list(_TOPICS)
    rng.shuffle(topics)
    out = []
    for i in range(n):
        topic, rnd = topics[i % len(topics)], i // len(topics)
        out.append(f"notes/{topic}.md" if rnd == 0 else f"notes/{topic}-{rnd + 1}.md")
    return out


def _overhead(data: TaskData, paths: Sequence[str], question: str) -> int:
    """Tokens of the transcript at its first question, less the files' texts."""
    count = data.count
    calls = sum(
        count(json.dumps({"name": TOOL, "arguments": {"path": p}})) + count("<tool_call>") * 2
        for p in paths
    )
    texts = [SYSTEM, _request(paths), _done(len(paths)), question]
    messages = len(texts) + 2 * len(paths)
    return sum(count(t) for t in texts) + calls + MESSAGE_TOKENS * messages


@dataclass(frozen=True)
class _Fact:
    fact: str
    question: str
    answer: str


def _clashes(f: _Fact, others: Sequence[_Fact]) -> bool:
    """Same question, or an answer that one fact's text spells inside another's."""
    a = f.answer.lower()
    return any(
        f.question == o.question or a in o.fact.lower() or o.answer.lower() in f.fact.lower()
        for o in others
    )


def _draw(rng: random.Random, others: Sequence[_Fact]) -> _Fact:
    for _ in range(_DRAWS):
        f = _Fact(*planted_fact(rng.randrange(2**31)))
        if not _clashes(f, others):
            return f
    raise RuntimeError("agentic: no fresh fact left to draw")


def agentic(data: TaskData, length: int, seed: int) -> AgenticSample:
    """A transcript of about ``length`` tokens at its first question, from ``seed``."""
    if length < MIN_LENGTH:
        raise ValueError(f"agentic: a length of {length} tokens is too short for a "
                         f"transcript of files (at least {MIN_LENGTH})")
    rng = random.Random(f"{TASK}/{seed}")
    n_files = max(2, math.ceil(length / FILE_TOKENS))
    per_file = math.ceil(TURNS / n_files)
    paths = _paths(rng, n_files)
    drawn: list[_Fact] = []
    for _ in range(n_files * per_file):
        drawn.append(_draw(rng, drawn))
    facts = [drawn[i * per_file : (i + 1) * per_file] for i in range(n_files)]
    order = list(range(n_files))
    rng.shuffle(order)
    asked = [(i, j) for j in range(per_file) for i in order][:TURNS]
    rng.shuffle(asked)
    first = facts[asked[0][0]][asked[0][1]].question
    tokens = (length - _overhead(data, paths, first)) // n_files
    doc_seeds = [rng.randrange(2**31) for _ in range(n_files)]
    texts = ["\n\n".join(e) for e in data.essays]
    docs = [_document(data, tokens, facts[i], doc_seeds[i], texts) for i in range(n_files)]
    for attempt in range(_DRAWS + 1):
        bad = _ambiguous(docs, facts)
        if bad is None:
            break
        if attempt == _DRAWS:
            raise RuntimeError("agentic: could not draw facts whose answers are unambiguous")
        i, j = bad
        everyone = [g for fs in facts for g in fs if g is not facts[i][j]]
        facts[i][j] = _draw(rng, everyone)
        docs[i] = _document(data, tokens, facts[i], doc_seeds[i], texts)
    return _sample(length, seed, paths, docs, facts, asked)


def _document(
    data: TaskData, tokens: int, facts: Sequence[_Fact], seed: int, texts: Sequence[str]
) -> PlantedDoc:
    return planted_document(
        data.count, tokens, facts[0].fact, seed, texts=texts,
        more_facts=[f.fact for f in facts[1:]],
    )


def _ambiguous(
    docs: Sequence[PlantedDoc], facts: Sequence[Sequence[_Fact]]
) -> tuple[int, int] | None:
    """The first fact whose answer is in a file other than its own (``(file, index)``)."""
    lowered = [d.text.lower() for d in docs]
    for i, fs in enumerate(facts):
        for j, f in enumerate(fs):
            a = f.answer.lower()
            if sum(a in text for text in lowered) != 1:
                return i, j
    return None


def _sample(
    length: int,
    seed: int,
    paths: Sequence[str],
    docs: Sequence[PlantedDoc],
    facts: Sequence[Sequence[_Fact]],
    asked: Sequence[tuple[int, int]],
) -> AgenticSample:
    sep = "\n\n"
    files, offset = [], 0
    for p, d in zip(paths, docs, strict=True):
        files.append(ToolFile(p, offset, offset + len(d.text)))
        offset += len(d.text) + len(sep)
    context = sep.join(d.text for d in docs)
    turns = []
    for i, j in asked:
        d, f = docs[i], facts[i][j]
        a, b = (d.fact_start, d.fact_end) if j == 0 else d.others[j - 1]
        base = files[i].start
        turns.append(Turn(f.question, (f.answer,), i, (base + a, base + b)))
    return AgenticSample(
        task=TASK,
        family=FAMILY,
        length=length,
        seed=seed,
        context=context,
        question=turns[0].question,
        answers=turns[0].answers,
        evidence=tuple(t.evidence for t in turns),
        meta={"files": len(files), "turns": len(turns)},
        request=_request(paths),
        files=tuple(files),
        turns=tuple(turns),
    )
