"""The controller: everything the engine may ask of the request a sequence belongs to.

The engine steps sequences; what each one reads, how its logits are shaped and when it
stops are decided by the layer above (a DA session, a vanilla request, a sparse
baseline, a forced transcript in a benchmark). That layer hands the engine one
``Controller`` per sequence, and the engine calls nothing else on it. The defaults are
a vanilla request's answers (read everything, leave the logits alone, never stop
early), so a controller overrides only what it decides.

Wrappers (the server's fault fence) extend this class and forward every hook, so a
hook added here is one the type checker finds missing in a wrapper that forgets it,
instead of a ``getattr`` probe that silently falls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from declattn.protocol.layout import RESPONSE, SCAFFOLD


@dataclass(frozen=True)
class ForcedTokens:
    """Tokens a request's protocol fixes next (a closing tag, the rest of a decided one):
    the engine appends them without sampling, and the sequence's next forward computes
    all of them at once, one row each, instead of one decode step each.

    ``replaces_last`` is token healing: the newest token (not yet in the KV cache) is
    taken back and ``tokens`` written in its place, so the text keeps the tokenisation
    the model itself would give it. Their decoded text must start with the taken-back
    token's text, which was already reported; only what follows it is reported again.
    """

    tokens: tuple[int, ...]
    replaces_last: bool = False


class Controller:
    """One request's decisions for the engine; the base answers as vanilla does.

    ``prompt_ids`` are the tokens the sequence is prefilled with.
    """

    selects_blocks: bool = False
    """True for query-aware controllers: ``select_blocks`` then decides, on every global
    layer of a decode step, which blocks that layer reads (the view is its fallback)."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)

    def view(self, length: int) -> Sequence[int] | None:
        """Logical blocks the next decode step (reading ``length`` positions) may read;
        ``None`` reads all. Called once per decode step, before the step runs."""
        return None

    def select_blocks(self, layer: int, q: Tensor) -> Sequence[int] | None:
        """The blocks global ``layer`` reads, given the step's query ``[H, D]``; only
        called when ``selects_blocks`` is True. ``None`` falls back to the view."""
        raise NotImplementedError(f"{type(self).__name__} does not select blocks")

    def process_logits(self, logits: Tensor) -> Tensor:
        """Shape the next token's logits (constrained decoding); identity by default.
        ``logits``: one ``[vocab]`` row in the output head's dtype (bf16 for a bf16 model:
        the engine samples from it as it is)."""
        return logits

    def on_token(self, token_id: int, text: str) -> str | None:
        """Called after each sampled token with its text; a returned reason finishes
        the sequence."""
        return None

    def forced(self) -> ForcedTokens | None:
        """Tokens the protocol fixes next, appended without sampling (jump-forward);
        ``None`` (the default) samples the next token as usual.

        Asked once at admission: tokens returned then are the reply's fixed start,
        accepted when the prompt's last piece runs and computed in that forward (no
        healing: there is no token to take back). Then asked after each sampled token,
        and each token forced after one, while the sequence goes on; tokens it returned
        are appended first, each through the ordinary acceptance (text, stop strings,
        ``max_tokens``, EOS, ``on_token``). The view of each row is asked for in order,
        interleaved with ``on_token``: a row's view is the state after its input token,
        as in decode. A row whose sequence the controller itself finishes before the
        next forward (its ``on_token`` returns a reason) never runs, though its view was
        asked for."""
        return None

    def regions(self, start: int, stop: int) -> list[int]:
        """The region of each position in ``[start, stop)`` (see ``Layout.regions``),
        for models that never mix a token's neighbours across regions. A plain prompt
        is one scaffold region, then the response."""
        n = len(self.prompt_ids)
        return [SCAFFOLD if p < n else RESPONSE for p in range(start, stop)]


class Delegating(Controller):
    """A wrapper that forwards every hook to ``inner``; subclasses override what they
    change. Forwarding is complete by construction, so wrapping a controller can never
    silently drop one of its decisions (regions, block selection, ...)."""

    def __init__(self, inner: Controller) -> None:
        super().__init__(inner.prompt_ids)
        self.inner = inner
        self.selects_blocks = inner.selects_blocks

    def view(self, length: int) -> Sequence[int] | None:
        return self.inner.view(length)

    def select_blocks(self, layer: int, q: Tensor) -> Sequence[int] | None:
        return self.inner.select_blocks(layer, q)

    def process_logits(self, logits: Tensor) -> Tensor:
        return self.inner.process_logits(logits)

    def on_token(self, token_id: int, text: str) -> str | None:
        return self.inner.on_token(token_id, text)

    def forced(self) -> ForcedTokens | None:
        return self.inner.forced()

    def regions(self, start: int, stop: int) -> list[int]:
        return self.inner.regions(start, stop)


class Forced(Delegating):
    """Teacher forcing: ``inner`` decides everything but the next token, which is the
    script's next one while the script lasts (the inner logits hook still runs first,
    so a constraint sees every step; past the script its logits stand, and the inner
    controller's forced tokens are appended again).

    ``logits`` keeps each step's logits as the model produced them when ``keep_logits``
    (oracle tests compare them across runs)."""

    def __init__(self, inner: Controller, tokens: Sequence[int], *, keep_logits: bool = False):
        super().__init__(inner)
        self.tokens = list(tokens)
        self.keep_logits = keep_logits
        self.logits: list[Tensor] = []
        self.n = 0
        self._forced: Tensor | None = None  # -inf but at the last forced token
        self._last = 0

    def process_logits(self, logits: Tensor) -> Tensor:
        """The inner hook's logits past the script; before, -inf but at the scripted
        token. One tensor serves every step (the engine samples from it and drops it):
        a fresh one a step cost a vocabulary-sized fill in every benchmarked step."""
        if self.keep_logits:
            self.logits.append(logits.clone())
        shaped = self.inner.process_logits(logits)
        if self.n >= len(self.tokens):
            return shaped
        forced = self._forced
        if forced is None or (forced.shape, forced.dtype, forced.device) != (
            logits.shape, logits.dtype, logits.device
        ):
            forced = self._forced = torch.full_like(logits, float("-inf"))
        else:
            forced[self._last] = float("-inf")
        self._last = self.tokens[self.n]
        forced[self._last] = 0.0
        return forced

    def on_token(self, token_id: int, text: str) -> str | None:
        self.n += 1
        return self.inner.on_token(token_id, text)

    def forced(self) -> ForcedTokens | None:
        """None while the script lasts: the script fixes every token, the inner
        controller's jump-forward would write past it."""
        return None if self.n < len(self.tokens) else self.inner.forced()
