"""The main job's task: one invented fact planted as its own paragraph in essay prose.

The same generator as ``declattn demo`` (``essays.planted_document`` and
``essays.planted_fact``), so the study of the main job is a run of the harness. Unlike
RULER's needle questions, the question carries no answer-format order ("answer with the
number only") that would compete with the DA instruction.
"""

from __future__ import annotations

from declattn.corpora.build import TaskData
from declattn.corpora.essays import planted_document, planted_fact
from declattn.eval.sample import Sample
from declattn.eval.tasks.base import PLAIN_SCAFFOLD, Draw


def planted(data: TaskData, length: int, seed: int) -> Sample:
    fact, question, answer = planted_fact(seed)
    texts = ["\n\n".join(e) for e in data.essays]  # this part's essays (split.py)
    doc = planted_document(data.count, max(100, length - PLAIN_SCAFFOLD), fact, seed, texts=texts)
    return Draw("planted", "planted", length, seed).sample(
        doc.text, question, [answer], [(doc.fact_start, doc.fact_end)], meta={"fact": fact}
    )
