"""What the find constraint costs: per tokenizer, per request, and per decode step.

The find constraint (``declattn.constrain_find``) runs inside the decode loop of every
constrained step, so its cost is measured on a long context with a real tokenizer:

- per tokenizer (once per process): decoding and folding the whole vocabulary;
- per request: folding and indexing the chunk texts, and the candidates right after
  ``find="`` (every word start of the context is a continuation there);
- per step, at every step inside a declaration while real phrases from the context are
  written token by token: choosing the allowed tokens, and masking a full-vocabulary
  logits row with them (together, what ``apply`` does), beside the same two for the id
  constraint on ``<focus magic_chunks="K">``, measured in the same process.

Run: ``python -m declattn.bench.find_constraint [--model qwen2.5-0.5b] [--tokens 16384]
[--context FILE] [--json OUT]``. Without ``--context`` the text is the bundled essay
followed by the licence texts of ``/usr/share/common-licenses`` (Debian), cut at
``--tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from declattn.bench.machine import machine_info
from declattn.bench.segment import sample_text
from declattn.constrain import ConstraintStats, FocusVocab, mask_logits
from declattn.constrain_find import FindConstraint, FindVocab
from declattn.engine.detok import Detokenizer
from declattn.engine.tokenizer import load_tokenizer
from declattn.protocol.find import PhraseFinder
from declattn.protocol.segment import segment, token_counter

LICENSES = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "GPL-2")


def default_context() -> str:
    parts = [sample_text()]
    parts += [(LICENSES / f).read_text() for f in LICENSE_FILES if (LICENSES / f).is_file()]
    return "\n\n".join(parts)


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _phrases(chunks: list[str], n: int, seed: int = 16) -> list[str]:
    """``n`` phrases of 2 to 6 words copied from the chunks, at seeded places."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words = rng.choice(chunks).split()
        if len(words) < 8:
            continue
        k = rng.randrange(2, 7)
        at = rng.randrange(0, len(words) - k)
        phrase = " ".join(words[at : at + k]).replace('"', "")
        if any(c in phrase for c in "<>"):
            continue
        out.append(phrase)
    return out


Step = tuple[float, float, int]  # seconds choosing the tokens, seconds masking, allowed


def _steps(
    tokenizer: Any, tag: str, allowed: Callable[[str], Any], vocab_size: int
) -> list[Step]:
    """Write ``tag`` token by token; at every step inside the declaration, time choosing
    the allowed tokens and masking a full logits row with them (what ``apply`` does)."""
    detok, pending, out = Detokenizer(tokenizer), "", []
    gen = torch.Generator().manual_seed(0)
    stats = ConstraintStats()
    for index, token_id in enumerate(tokenizer.encode(tag, add_special_tokens=False)):
        logits = torch.randn(vocab_size, generator=gen)
        start = time.perf_counter()
        ids = allowed(pending)
        chosen = time.perf_counter()
        if ids is not None:
            mask_logits(logits, ids, stats, index)
            out.append((chosen - start, time.perf_counter() - chosen, len(ids)))
        pending += detok.add(token_id)
    return out


def _summary(steps: list[Step]) -> dict[str, Any]:
    def stats(ms: list[float]) -> dict[str, float]:
        ms = sorted(ms)
        return {
            "median_ms": statistics.median(ms),
            "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
            "max_ms": ms[-1],
        }

    return {
        "steps": len(steps),
        "total": stats([(a + b) * 1e3 for a, b, _ in steps]),
        "choose": stats([a * 1e3 for a, _, _ in steps]),
        "mask": stats([b * 1e3 for _, b, _ in steps]),
        "mean_allowed": statistics.fmean(n for _, _, n in steps),
    }


def bench(model: str, n_tokens: int, context: str | None, n_phrases: int) -> dict[str, Any]:
    tok = load_tokenizer(model)
    vocab_size = len(tok)
    text = default_context() if context is None else context
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n_tokens:
        raise SystemExit(f"the context has {len(ids)} tokens, fewer than --tokens {n_tokens}")
    text = tok.decode(ids[:n_tokens])
    chunks = [c.text for c in segment(text, token_counter(tok))]

    find_vocab, t_find_vocab = _timed(lambda: FindVocab.from_tokenizer(tok))
    focus_vocab, t_focus_vocab = _timed(lambda: FocusVocab.from_tokenizer(tok))
    finder, t_finder = _timed(lambda: PhraseFinder(chunks))
    _, t_index = _timed(finder.prepare)
    constraint = FindConstraint(find_vocab, finder)
    _, t_first = _timed(constraint.prepare)

    phrases = _phrases(chunks, n_phrases)
    find_steps: list[Step] = []
    resolved = 0
    for phrase in phrases:
        find_steps += _steps(tok, f'<focus find="{phrase}">', constraint.allowed_index, vocab_size)
        resolved += finder.resolve(phrase).accepted
    id_steps: list[Step] = []
    for k in range(n_phrases):
        tag = f'<focus magic_chunks="{1 + k % len(chunks)}">'
        id_steps += _steps(tok, tag, lambda p: focus_vocab.allowed(p, len(chunks)), vocab_size)
    find_sum, id_sum = _summary(find_steps), _summary(id_steps)
    return {
        "machine": machine_info(),
        "model": model,
        "vocab": vocab_size,
        "context_tokens": n_tokens,
        "chunks": len(chunks),
        "words": finder.n_words,
        "per_tokenizer_s": {"find_vocab": t_find_vocab, "focus_vocab": t_focus_vocab},
        "per_request_ms": {
            "finder": t_finder * 1e3,
            "prefix_index": t_index * 1e3,
            "first_step": t_first * 1e3,
            "total": (t_finder + t_index + t_first) * 1e3,
        },
        "phrases": len(phrases),
        "phrases_resolved": resolved,
        "find_step": find_sum,
        "id_step": id_sum,
        "find_over_id_median": find_sum["total"]["median_ms"] / id_sum["total"]["median_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m declattn.bench.find_constraint")
    p.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer")
    p.add_argument("--tokens", type=int, default=16384, help="context length in tokens")
    p.add_argument("--context", help="a text file (default: essay + Debian licence texts)")
    p.add_argument("--phrases", type=int, default=40, help="phrases written under the constraint")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    context = Path(args.context).read_text("utf-8") if args.context else None
    result = bench(args.model, args.tokens, context, args.phrases)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
