"""The runaway guard: stop a response that loops, or that can no longer reach its answer.

Small models fall into loops (the same sentence, the same tag pair, the same line) and
then spend the whole token budget on them; a DA response that never opens ``<answer>``
is worth nothing, however long it runs. The guard watches the tokens and text of one
response and names a finish reason when it should stop:

- ``runaway:repeat``: the last tokens are one block of ``K`` tokens repeated back to
  back, over at least ``min_span`` tokens and at least ``min_reps`` times.
- ``runaway:repeat_lines``: the same non-blank line ``line_repeats`` times in a row
  (blank lines between them do not break the run).
- ``runaway:no_answer``: the budget left cannot fit an answer and none is open.

A legitimate list or table does not trip it: its lines differ (a number, a name, a
cell), so neither the tokens nor the lines repeat exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPEAT = "runaway:repeat"
REPEAT_LINES = "runaway:repeat_lines"
NO_ANSWER = "runaway:no_answer"


@dataclass(frozen=True)
class RunawayConfig:
    """Thresholds; the defaults favour letting a response run over cutting a good one."""

    max_period: int = 64
    min_span: int = 48
    min_reps: int = 2
    line_repeats: int = 5
    answer_reserve: int = 32

    def __post_init__(self) -> None:
        if self.max_period < 1 or self.min_span < 2 or self.min_reps < 2:
            raise ValueError("max_period >= 1, min_span >= 2 and min_reps >= 2 are required")
        if self.line_repeats < 2 or self.answer_reserve < 0:
            raise ValueError("line_repeats >= 2 and answer_reserve >= 0 are required")

    def reserve(self, max_tokens: int) -> int:
        """Tokens kept for the answer; at most a quarter of a small budget."""
        return min(self.answer_reserve, max_tokens // 4)


@dataclass
class RunawayGuard:
    """Watches one response; ``on_token`` returns a finish reason once it should stop.

    ``max_tokens`` is the response's token budget; without it the no-answer rule is off.
    After a trip, ``reason`` and ``detail`` say why (for the run record).
    """

    config: RunawayConfig = field(default_factory=RunawayConfig)
    max_tokens: int | None = None
    n_tokens: int = 0
    reason: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    _tokens: list[int] = field(default_factory=list, repr=False)
    _runs: list[int] = field(default_factory=list, repr=False)
    _line: str = field(default="", repr=False)
    _last_line: str | None = field(default=None, repr=False)
    _line_count: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        # _runs[k - 1]: how many of the newest tokens equal the token k places before them
        self._runs = [0] * self.config.max_period

    def on_token(self, token_id: int, text: str, answer_open: bool) -> str | None:
        """Account one token; ``answer_open`` says whether ``<answer>`` has been written."""
        self.n_tokens += 1
        if self.reason is None:
            self.reason = (
                self._tokens_repeat(token_id)
                or self._lines_repeat(text)
                or self._out_of_budget(answer_open)
            )
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "tokens": self.n_tokens, **self.detail}

    # -- rules ---------------------------------------------------------------------------

    def _tokens_repeat(self, token_id: int) -> str | None:
        c = self.config
        toks = self._tokens
        toks.append(token_id)
        if len(toks) > 4 * c.max_period:  # only the last max_period tokens are compared
            del toks[: -c.max_period - 1]
        i = len(toks) - 1
        found = None
        for k in range(1, c.max_period + 1):
            if i >= k and toks[i - k] == token_id:
                self._runs[k - 1] += 1
            else:
                self._runs[k - 1] = 0
            span = self._runs[k - 1] + k  # the newest `span` tokens have period k
            if found is None and span >= max(c.min_span, c.min_reps * k):
                found = k
        if found is None:
            return None
        self.detail = {"period": found, "span": self._runs[found - 1] + found}
        return REPEAT

    def _lines_repeat(self, text: str) -> str | None:
        *done, self._line = (self._line + text).split("\n")
        for line in done:
            line = line.strip()
            if not line:
                continue
            if line == self._last_line:
                self._line_count += 1
            else:
                self._last_line, self._line_count = line, 1
            if self._line_count >= self.config.line_repeats:
                self.detail = {"line": line, "count": self._line_count}
                return REPEAT_LINES
        return None

    def _out_of_budget(self, answer_open: bool) -> str | None:
        if self.max_tokens is None or answer_open:
            return None
        left = self.max_tokens - self.n_tokens
        reserve = self.config.reserve(self.max_tokens)
        if reserve and left <= reserve:
            self.detail = {"left": left, "reserve": reserve}
            return NO_ANSWER
        return None
