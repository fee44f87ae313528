"""What the evaluation's task generators share beyond the document builders
(``corpora/build.py``): sizing a context so the ordinary prompt hits a length."""

from __future__ import annotations

from declattn.corpora.build import TokenCounter
from declattn.eval.sample import plain_question

PLAIN_SCAFFOLD = 24
"""Tokens an ordinary chat prompt adds around context and question (system turn, role
headers): subtracted from the requested length so the rendered vanilla prompt lands on it."""


def context_target(
    count: TokenCounter, length: int, question: str, answer_format: str = ""
) -> int:
    """Context tokens for a sample whose ordinary prompt should be ``length`` tokens."""
    target = length - count(plain_question(question, answer_format)) - PLAIN_SCAFFOLD
    if target < 64:
        raise ValueError(f"a length of {length} tokens leaves no room for a context")
    return target
