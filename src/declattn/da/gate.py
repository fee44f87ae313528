"""The break-even gate by the whole answer: run DA only where its reply is expected to
cost less than the plain reply to the same question.

A decode step on a CPU is bound by the bytes it reads: the model's weights once per
forward, plus the KV positions its view keeps. So the cost of a reply, in bytes, is the
sum over its forwards of ``weights + kv_per_token x kept positions``, and the time is
that over the bandwidth; the bandwidth cancels in the ratio. A DA reply has more tokens
than the plain one (its tags), but most of them read only the scaffold or one chunk; a
plain reply reads the whole context every step. Which one is cheaper depends on the
context length, the chunk size, the model's weight bytes against its KV bytes per token
(a small model's weights dominate until long contexts), and the length and shape of the
replies, which come from measurement (``ReplyShape``; docs/eval.md gives the study).

In a batch the weights are read once per step for every request in it, so a request's
share of them is ``weight_bytes / batch`` while its KV is its own (``batch``: the
requests decoding together). Extra forwards cost little there, and DA pays where a lone
request would not (docs/benchmarks.md, "Serving": the shipped default at N = 8).

focus-llama states the same balance as ``(1 + extra output) x (global share + (1 -
global share) x focus-step cost ratio)``; this module computes it per request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplyShape:
    """How many forwards a reply takes, by what they read: ``scaffold`` forwards read the
    scaffold only (tags, under the scaffold rule, or local blocks), ``focus`` forwards
    one focused chunk (an answer written inside a focus included), ``full`` forwards the
    whole prompt (global blocks); ``plain`` is the plain reply's length in tokens."""

    scaffold: float
    focus: float
    full: float
    plain: float


ECONOMY_SHAPE = ReplyShape(scaffold=5.0, focus=6.5, full=0.0, plain=7.5)
"""The economical protocol (a find focus, the answer right after it): its tag words and
tags read the scaffold; the answer reads one chunk. The medians of qwen2.5-0.5b's
decode forwards by what they read, and of its plain replies' forwards, in the per-answer
study at 16K (docs/eval.md, "The per-answer study"). With them a lone request runs DA
from about 19K context tokens on that model, two requests together from about 10K,
eight from about 4K."""

CLASSIC_SHAPE = ReplyShape(scaffold=8.0, focus=24.0, full=35.0, plain=12.0)
"""The chunk-id protocol with a global survey first (``DA_INSTRUCTION``): long replies
whose global block reads everything; medians from the same study."""


@dataclass(frozen=True)
class ReplyCost:
    """A request's expected reply costs, in bytes read, and the decision."""

    da_bytes: float
    plain_bytes: float

    @property
    def ratio(self) -> float:
        """DA's expected bytes over the plain reply's."""
        return self.da_bytes / self.plain_bytes

    @property
    def run_da(self) -> bool:
        return self.ratio < 1.0


def expected_cost(
    *,
    context_tokens: int,
    prompt_tokens: int,
    scaffold_tokens: int,
    chunk_tokens: int,
    weight_bytes: int,
    kv_bytes_per_token: int,
    shape: ReplyShape,
    batch: int = 1,
) -> ReplyCost:
    """The expected bytes of a DA reply and of the plain reply to the same question.

    ``prompt_tokens``: the DA prompt (the plain one is taken as long as the context plus
    the scaffold); ``scaffold_tokens``: what a scaffold step keeps (sink and question
    window); ``chunk_tokens``: one chunk, what a focus adds; ``batch``: the requests
    decoding together, who share each forward's weights."""
    if min(context_tokens, prompt_tokens, weight_bytes, kv_bytes_per_token, batch) <= 0:
        raise ValueError("token counts, byte sizes and the batch must be positive")
    w, k = float(weight_bytes) / batch, float(kv_bytes_per_token)
    da = (
        shape.scaffold * (w + k * scaffold_tokens)
        + shape.focus * (w + k * (scaffold_tokens + chunk_tokens))
        + shape.full * (w + k * prompt_tokens)
    )
    plain = shape.plain * (w + k * (context_tokens + scaffold_tokens))
    return ReplyCost(da, plain)
