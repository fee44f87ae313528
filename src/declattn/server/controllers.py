"""Per-request engine controllers the server adds: plain chat, and a fault fence.

``PlainChat`` is the vanilla controller for a prompt that is already tokenised (a chat
rendered through the template, or a raw completion prompt): it reads everything and
counts what it reads, so plain requests report the same usage figures as DA ones.

``Guarded`` wraps any controller so that an exception inside it fails only its own
sequence: the engine steps a whole batch, and one request's broken hook must not take
the other requests, or the stepping loop, down with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from declattn.accounting import Accounting, StepRecord
from declattn.protocol.modes import Mode
from declattn.scope import StepCount

ERROR_REASON = "error"


class PlainChat:
    """A vanilla request over a ready token list: every step reads every position."""

    mode_name = "vanilla"

    def __init__(self, prompt_ids: list[int], block_size: int) -> None:
        self.prompt_ids = prompt_ids
        self.block_size = block_size
        self.accounting = Accounting()
        self.text = ""

    def view(self, length: int) -> Sequence[int] | None:
        physical = -(-length // self.block_size) * self.block_size
        count = StepCount(length, physical, length, physical)
        self.accounting.add(
            StepRecord.from_count(self.accounting.steps + 1, Mode.GLOBAL, (), length, count)
        )
        return None

    def on_token(self, token_id: int, text: str) -> str | None:
        self.text += text
        return None


class Guarded:
    """A controller that turns the inner controller's exceptions into a finish.

    After a failure the sequence reads everything for the rest of the step (the safe
    view) and finishes with reason ``"error"``; ``error`` keeps the exception.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.error: BaseException | None = None

    def view(self, length: int) -> Sequence[int] | None:
        hook = getattr(self.inner, "view", None)
        if hook is None or self.error is not None:
            return None
        try:
            return hook(length)
        except Exception as e:  # any failure fails only this request
            self.error = e
            return None

    def process_logits(self, logits: Any) -> Any:
        hook = getattr(self.inner, "process_logits", None)
        if hook is None or self.error is not None:
            return logits
        try:
            return hook(logits)
        except Exception as e:
            self.error = e
            return logits

    def on_token(self, token_id: int, text: str) -> str | None:
        hook = getattr(self.inner, "on_token", None)
        reason = None
        if hook is not None and self.error is None:
            try:
                reason = hook(token_id, text)
            except Exception as e:
                self.error = e
        return ERROR_REASON if self.error is not None else reason
