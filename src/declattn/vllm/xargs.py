"""A DA request as flat request arguments, the only form that reaches vLLM's engine core.

vLLM carries per-request extras in ``SamplingParams.extra_args`` (``vllm_xargs`` over
HTTP), whose values may be strings, numbers or flat lists of them, never nested objects.
So the layout travels as a few integer lists; everything else is a number or a short
string. Plain requests carry none of these keys and are never touched.

Two kinds of request carry them: a DA request (``DASpec``: the layout, the reader's and
the constraints' settings) and a StreamingLLM baseline request (``StreamingSpec``: the
ordinary prompt read through a sink and a recent window of ``da_streaming`` blocks, the
evaluation's ``streaming`` arm). Both name ``da_prompt_len``.

The find focus needs the chunk texts in the engine core; they do not travel here (they
would double a request's size): the engine core decodes them from the prompt's chunk
spans, which the layout names and which decode to the chunk texts exactly (the renderer
checks that, ``protocol.template.verify_span``). ``index`` (the in-context index of the
find instruction) is not here either: it changes only the prompt, which the front end
builds (``build_request``).

No torch and no vLLM here: the front end (request builder, HTTP client) and the engine
core (logits processor) both use this one codec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from declattn.da.options import FOCUS_FORMS
from declattn.protocol.layout import Layout, Span

PROMPT_LEN = "da_prompt_len"
SINK = "da_sink"  # [start, end]
QUESTION = "da_question"  # [start, end]
CHUNKS = "da_chunks"  # [start_1, end_1, start_2, end_2, ...]
LINE_START = "da_line_start"  # 0 or 1
MASKING = "da_masking"  # 0 (DA-nm: tags are read, nothing is skipped) or 1
CONSTRAIN = "da_constrain"  # 0 or 1: the focus-id constraint on the logits
FOCUS = "da_focus"  # "ids", "find" or "both": which focus constraint(s) da_constrain sets
SCAFFOLD = "da_scaffold"  # 0 or 1: steps writing protocol text read as local (DAOptions)
ANSWER = "da_require_answer"  # 0 or 1: no end of the response before an <answer>
OPEN = "da_open_tag"  # 0 or 1: the response's first token begins a tag
AFTER_FIND = "da_answer_after_find"  # 0 or 1: <answer> comes right after a find focus
FORCE = "da_force"  # token ids the response must start with (teacher forcing)
LABEL = "da_label"  # a name for the request in the engine core's read log
STREAMING = "da_streaming"  # a StreamingLLM request: blocks read per decode step

KEYS = (PROMPT_LEN, SINK, QUESTION, CHUNKS, LINE_START, MASKING, CONSTRAIN, FOCUS, SCAFFOLD,
        ANSWER, OPEN, AFTER_FIND, FORCE, LABEL, STREAMING)


class BadDAArgs(ValueError):
    """The extra args name a DA request but do not describe a valid one."""


@dataclass(frozen=True)
class DASpec:
    """What the engine core needs to run one DA request."""

    layout: Layout
    line_start: bool = False
    masking: bool = True
    constrain: bool = False
    force: tuple[int, ...] = ()
    label: str | None = None
    focus: str = "ids"
    scaffold_local: bool = False
    require_answer: bool = False
    open_tag: bool = False
    answer_after_find: bool = False

    def __post_init__(self) -> None:
        if self.focus not in FOCUS_FORMS:
            raise BadDAArgs(f"{FOCUS} must be one of {', '.join(FOCUS_FORMS)}, "
                            f"got {self.focus!r}")

    @property
    def prompt_len(self) -> int:
        return self.layout.prompt_len

    @property
    def needs_tag_vocab(self) -> bool:
        """``DAOptions.needs_tag_vocab``, for the flags a request carries."""
        return self.open_tag or self.answer_after_find

    def constraints(self) -> tuple[bool, bool]:
        """Whether the focus-id and the find constraint apply (``DASession``'s rule)."""
        return (self.constrain and self.focus in ("ids", "both"),
                self.constrain and self.focus in ("find", "both"))

    def to_args(self) -> dict[str, Any]:
        """Flat ``extra_args`` / ``vllm_xargs`` values."""
        lay = self.layout
        args: dict[str, Any] = {
            PROMPT_LEN: lay.prompt_len,
            SINK: [lay.sink.start, lay.sink.end],
            QUESTION: [lay.question.start, lay.question.end],
            CHUNKS: [x for s in lay.chunks for x in (s.start, s.end)],
            LINE_START: int(self.line_start),
            MASKING: int(self.masking),
            CONSTRAIN: int(self.constrain),
            FOCUS: self.focus,
            SCAFFOLD: int(self.scaffold_local),
            ANSWER: int(self.require_answer),
            OPEN: int(self.open_tag),
            AFTER_FIND: int(self.answer_after_find),
        }
        if self.force:
            args[FORCE] = list(self.force)
        if self.label is not None:
            args[LABEL] = self.label
        return args


@dataclass(frozen=True)
class StreamingSpec:
    """A StreamingLLM baseline request: the ordinary prompt; each decode step reads the
    blocks covering the first ``sink_tokens`` positions and the most recent ones,
    ``budget`` blocks in all (``eval.baselines.streaming_view``)."""

    prompt_len: int
    budget: int
    sink_tokens: int = 16
    label: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.budget < 1 or self.sink_tokens < 0:
            raise BadDAArgs(f"a streaming request needs {PROMPT_LEN} >= 1, {STREAMING} >= 1 "
                            f"and a sink >= 0, got {self.prompt_len}, {self.budget}, "
                            f"{self.sink_tokens}")

    def to_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {PROMPT_LEN: self.prompt_len, STREAMING: self.budget,
                                SINK: [0, self.sink_tokens]}
        if self.label is not None:
            args[LABEL] = self.label
        return args


def is_da(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request asked for DA (it names a prompt length)."""
    return bool(extra_args) and PROMPT_LEN in extra_args


def _ints(value: Any, name: str) -> list[int]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise BadDAArgs(f"{name} must be a list of integers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v:
            raise BadDAArgs(f"{name} must hold integers, got {v!r}")
        out.append(int(v))
    return out


def _pair(value: Any, name: str) -> Span:
    xs = _ints(value, name)
    if len(xs) != 2:
        raise BadDAArgs(f"{name} must be [start, end], got {value!r}")
    return Span(*xs)


def _flag(args: Mapping[str, Any], key: str, default: bool) -> bool:
    value = args.get(key, default)
    if value in (0, 1, True, False):
        return bool(value)
    raise BadDAArgs(f"{key} must be 0 or 1, got {value!r}")


def _int(value: Any, name: str) -> int:
    (out,) = _ints([value], name)
    return out


def parse(extra_args: Mapping[str, Any] | None) -> DASpec | StreamingSpec | None:
    """The spec in a request's extra args; None for a plain request.

    Raises ``BadDAArgs`` for a request whose args do not hold together (a layout that
    does not, an unknown focus form), so a malformed request is refused at validation
    rather than read wrongly.
    """
    if not is_da(extra_args):
        return None
    assert extra_args is not None
    label = extra_args.get(LABEL)
    try:
        prompt_len = _int(extra_args[PROMPT_LEN], PROMPT_LEN)
        if STREAMING in extra_args:
            sink = _pair(extra_args.get(SINK, [0, 16]), SINK)
            return StreamingSpec(prompt_len, _int(extra_args[STREAMING], STREAMING), sink.end,
                                 None if label is None else str(label))
        flat = _ints(extra_args.get(CHUNKS, []), CHUNKS)
        if len(flat) % 2 or not flat:
            raise BadDAArgs(f"{CHUNKS} must hold start, end pairs, at least one")
        chunks = tuple(Span(flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
        layout = Layout(
            prompt_len=prompt_len,
            sink=_pair(extra_args.get(SINK, [0, 0]), SINK),
            chunks=chunks,
            question=_pair(extra_args.get(QUESTION), QUESTION),
        )
        return DASpec(
            layout=layout,
            line_start=_flag(extra_args, LINE_START, False),
            masking=_flag(extra_args, MASKING, True),
            constrain=_flag(extra_args, CONSTRAIN, False),
            force=tuple(_ints(extra_args.get(FORCE, []), FORCE)),
            label=None if label is None else str(label),
            focus=str(extra_args.get(FOCUS, "ids")),
            scaffold_local=_flag(extra_args, SCAFFOLD, False),
            require_answer=_flag(extra_args, ANSWER, False),
            open_tag=_flag(extra_args, OPEN, False),
            answer_after_find=_flag(extra_args, AFTER_FIND, False),
        )
    except BadDAArgs:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise BadDAArgs(f"bad DA request arguments: {e}") from e
