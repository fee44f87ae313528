"""Aggregation over the whole context: the most common words of a list, and the most
frequent words of a coded text.

Neither answer lives in one place: every chunk holds part of the count. These tasks
are where reading less should cost accuracy, so they test DA's ``global`` mode and the
baselines' worst case. Their samples carry no evidence spans.
"""

from __future__ import annotations

import random
import string

from declattn.corpora.build import TaskData, TokenCounter, pick_words
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import Draw, context_target

FAMILY = "aggregation"
COMMON = 10
COMMON_REPEATS = 30
RARE_REPEATS = 3
FREQUENT = 3
ZIPF_ALPHA = 2.0
CODED_VOCAB = 1000
LINE_WORDS = 16


def _grow(count: TokenCounter, target: int, make, start: int) -> str:
    """The text of ``make(n)`` for the largest ``n`` whose text fits ``target`` tokens.

    ``make`` must grow with ``n``; a geometric guess from one count, then a bisection.
    """
    lo, text_lo = 0, ""
    n = max(1, start)
    while True:
        text = make(n)
        if count(text) > target:
            hi = n
            break
        lo, text_lo = n, text
        n *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        text = make(mid)
        if count(text) <= target:
            lo, text_lo = mid, text
        else:
            hi = mid
    return text_lo


def common_words(data: TaskData, length: int, seed: int) -> Sample:
    """A numbered word list: ten words repeated often, the others a few times each."""
    draw = Draw("cwe", FAMILY, length, seed)
    rng = draw.rng()
    question = f"What are the {COMMON} most common words in the numbered list above?"
    answer_format = f"Answer with the {COMMON} words."
    target = context_target(data.count, length, question, answer_format)
    pool = pick_words(rng, data.words, min(len(data.words), 12000))
    common, rare_pool = pool[:COMMON], pool[COMMON:]
    order_seed = rng.random()

    def make(n_rare: int) -> str:
        words = common * COMMON_REPEATS + rare_pool[:n_rare] * RARE_REPEATS
        random.Random(order_seed).shuffle(words)
        return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))

    if len(make(0)) and data.count(make(0)) > target:
        raise ValueError(f"{length} tokens cannot hold {COMMON} words x {COMMON_REPEATS}")
    context = _grow(data.count, target, make, start=max(1, target // 20))
    return draw.sample(
        context,
        question,
        common,
        (),
        meta={"common_repeats": COMMON_REPEATS, "rare_repeats": RARE_REPEATS},
        answer_format=answer_format,
    )


def _coded_vocab(rng: random.Random, n: int) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def frequent_words(data: TaskData, length: int, seed: int) -> Sample:
    """Coded words drawn with Zipf frequencies; the answer is the three most frequent."""
    draw = Draw("fwe", FAMILY, length, seed)
    rng = draw.rng()
    question = f"What are the {FREQUENT} most frequently appearing coded words in the text above?"
    answer_format = f"Answer with the {FREQUENT} words."
    target = context_target(data.count, length, question, answer_format)
    vocab = _coded_vocab(rng, CODED_VOCAB)
    weights = [(k + 1) ** -ZIPF_ALPHA for k in range(len(vocab))]
    norm = sum(weights)
    order_seed = rng.random()

    def make(n_words: int) -> str:
        counts = [int(n_words * w / norm) for w in weights]
        words = [v for v, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(order_seed).shuffle(words)
        lines = [" ".join(words[i : i + LINE_WORDS]) for i in range(0, len(words), LINE_WORDS)]
        return "\n".join(lines)

    context = _grow(data.count, target, make, start=max(8, target // 4))
    counts = {w: context.split().count(w) for w in vocab[: FREQUENT + 1]}
    if not counts[vocab[FREQUENT - 1]] > counts[vocab[FREQUENT]] > 0:
        raise ValueError(f"{length} tokens are too few to rank {FREQUENT} coded words apart")
    return draw.sample(
        context,
        question,
        vocab[:FREQUENT],
        (),
        meta={"alpha": ZIPF_ALPHA, "top_counts": counts},
        answer_format=answer_format,
    )
