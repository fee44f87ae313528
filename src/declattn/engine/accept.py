"""Token acceptance: a sequence's next token sampled from its logits, or forced by its
controller, turned into text and checked against the rules that finish a sequence.

Every token, sampled or forced, goes the same way: the detokenizer gives its text, a
stop string cuts it (a tail that may begin one is held back), EOS and ``max_tokens``
finish it, and the controller's ``on_token`` sees it and may finish it too. So a client
streaming the reply cannot tell a forced token from a sampled one.

Forced tokens (``Controller.forced``) are asked for at admission (the fixed start of a
reply, ``opening``) and after each sampled or forced token accepted while the sequence
goes on. They are not in the KV cache yet: the sequence's next forward computes
their rows with its newest token's. Each row's view is asked for when the token after it
is accepted, before ``on_token`` sees that token, so a row's view is the controller's
state after the row's own input token, as in decode; a token that finishes the sequence
by the engine's own rules (EOS, a stop string, ``max_tokens``) asks for none, since no
forward follows.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import Tensor

from declattn.engine.controller import ForcedTokens
from declattn.engine.request import Request, TokenEvent
from declattn.engine.sampler import sample
from declattn.engine.stops import cut_at_stop

_SELECTS = ("forced tokens need views known before the forward; a controller that "
            "selects blocks by query cannot force")


class Acceptor:
    """Accepts the tokens of the engine's sequences (``eos``: the ids that end one)."""

    def __init__(self, tokenizer: Any, eos: Collection[int], *, forcing: bool = True) -> None:
        """``forcing`` False never asks a controller for forced tokens: every token is
        sampled (the comparison with step-by-step decoding)."""
        self.tokenizer = tokenizer
        self.eos = set(eos)
        self.forcing = forcing

    def sampled(self, seq: Request, logits: Tensor) -> list[TokenEvent]:
        """Sample ``seq``'s next token from ``logits`` (the controller shapes them
        first), then append whatever the controller forces after it."""
        logits = seq.controller.process_logits(logits)
        token = sample(logits, seq.params, seq.generator)
        events = [self.accept(seq, token)]
        events += self._forced(seq)
        return events

    def opening(self, seq: Request) -> tuple[int, ...]:
        """The tokens ``seq``'s controller fixes before its first sample (the start of a
        reply), asked once, at admission; ``accept_opening`` accepts them in the step
        that completes the prompt, which runs their rows (``scheduler.py``)."""
        forced = seq.controller.forced() if self.forcing else None
        if forced is None or not forced.tokens:
            return ()
        if seq.controller.selects_blocks:
            raise ValueError(_SELECTS)
        if forced.replaces_last:
            raise ValueError("token healing takes back a sampled token, and a reply's "
                             "start has none")
        return tuple(forced.tokens)

    def accept_opening(self, seq: Request) -> list[TokenEvent]:
        """Accept ``seq.opening`` (until one finishes the sequence). What the controller
        forces after them is asked for after the next sampled token."""
        events: list[TokenEvent] = []
        for token in seq.opening:
            events.append(self.accept(seq, token))
            if seq.finish_reason is not None:
                break
        seq.opening = ()
        return events

    def accept(self, seq: Request, token: int, given: str = "") -> TokenEvent:
        """Append ``token`` to ``seq`` through the rules above. ``given``: text of a
        taken-back token this one replaces, already reported (token healing)."""
        length = seq.length  # what the newest token's row reads, if it runs before this
        waits = length > seq.kv_length  # the newest token is not in the KV cache yet
        seq.output_ids.append(token)
        text = seq.detok.add(token)
        reason = None
        if token in self.eos and not seq.params.ignore_eos:
            reason = "eos"
            text += seq.detok.flush()
        text, seq.held, stopped = cut_at_stop(seq.held, text, seq.params.stop, reason is None)
        reason = "stop" if stopped else reason
        if reason is None and len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is not None and reason != "stop":
            text += seq.held  # a finished response releases what it held back
            seq.held = ""
        seq.token_texts.append(given + text)
        if waits and reason is None:  # the row before this token runs with it
            view = seq.controller.view(length)
            seq.pending_views.append(None if view is None else tuple(view))
        reason = seq.controller.on_token(token, text) or reason
        if reason is not None:
            seq.finish_reason = reason
        return TokenEvent(seq.seq_id, token, text, len(seq.output_ids) - 1, reason)

    def _forced(self, seq: Request) -> list[TokenEvent]:
        """The tokens ``seq``'s controller forces, each accepted, until it forces none
        or the sequence finishes."""
        events: list[TokenEvent] = []
        first = True  # the newest token was sampled: only it may be taken back
        while self.forcing and seq.finish_reason is None:
            forced = seq.controller.forced()
            if forced is None or not forced.tokens:
                break
            if seq.controller.selects_blocks:
                raise ValueError(_SELECTS)
            tokens = list(forced.tokens)
            given = self._take_back(seq, forced, first) if forced.replaces_last else ""
            for token in tokens:
                events.append(self.accept(seq, token, given))
                given = ""
                if seq.finish_reason is not None:
                    break
            first = False
        return events

    def _take_back(self, seq: Request, forced: ForcedTokens, sampled: bool) -> str:
        """Take back ``seq``'s newest token for ``forced.tokens`` (token healing);
        returns the text it was reported with."""
        if not sampled:
            raise ValueError("token healing takes back a sampled token, and the newest "
                             "token was forced")
        last = seq.output_ids[-1]
        old = self.tokenizer.decode([last])
        new = self.tokenizer.decode(list(forced.tokens))
        if not new.startswith(old):
            raise ValueError(f"token healing: the forced text {new!r} does not start with "
                             f"the text {old!r} of the token it replaces")
        seq.output_ids.pop()
        seq.detok.take_back()
        return seq.token_texts.pop()
