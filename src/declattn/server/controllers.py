"""The fault fence the server puts around every request's controller.

The engine steps a whole batch, and one request's broken hook must not take the other
requests, or the stepping loop, down with it. ``Guarded`` wraps a controller so that an
exception inside any of its hooks fails only its own sequence. It forwards every hook
of ``Controller`` (view, block selection, logits, token, forced tokens, regions): a wrapper that
forwarded only some would silently turn the inner controller's decisions off.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from declattn.engine.controller import Controller, Delegating, ForcedTokens

ERROR_REASON = "error"


class Guarded(Delegating):
    """A controller that turns the inner controller's exceptions into a finish.

    After a failure the sequence reads everything for the rest of the step (the safe
    view) and finishes with reason ``"error"``; ``error`` keeps the exception. Regions
    are forwarded unfenced: a layout that cannot answer fails the prefill, which fails
    only this sequence.
    """

    def __init__(self, inner: Controller) -> None:
        super().__init__(inner)
        self.error: BaseException | None = None

    def view(self, length: int) -> Sequence[int] | None:
        if self.error is not None:
            return None
        try:
            return self.inner.view(length)
        except Exception as e:  # any failure fails only this request
            self.error = e
            return None

    def select_blocks(self, layer: int, q: Tensor) -> Sequence[int] | None:
        """The inner selection; after a failure, ``None`` (the view: read everything)."""
        if self.error is not None:
            return None
        try:
            return self.inner.select_blocks(layer, q)
        except Exception as e:
            self.error = e
            return None

    def process_logits(self, logits: Tensor) -> Tensor:
        if self.error is not None:
            return logits
        try:
            return self.inner.process_logits(logits)
        except Exception as e:
            self.error = e
            return logits

    def forced(self) -> ForcedTokens | None:
        """The inner controller's forced tokens; after a failure, none."""
        if self.error is not None:
            return None
        try:
            return self.inner.forced()
        except Exception as e:
            self.error = e
            return None

    def on_token(self, token_id: int, text: str) -> str | None:
        reason = None
        if self.error is None:
            try:
                reason = self.inner.on_token(token_id, text)
            except Exception as e:
                self.error = e
        return ERROR_REASON if self.error is not None else reason
