"""Run records for the show tests.

``record``: synthetic, no model, real replay and scope arithmetic. The steps come from
``declattn.da.replay`` and the blocks read from ``Scope``, so the record has the shape and
the one-step lag a live run writes, with text chosen to exercise every mode, a decline,
and HTML that must be escaped; it has no ``focus`` list, as records written before focus
diagnostics.

``find_record``: a real DA session (``focus="find"``) on a tiny random model with the
real SmolLM2 tokenizer, a transcript forced through it and the record written by
``build_record``: the reader resolved each ``find`` phrase against the chunk texts and
the attention read what the scope kept, exactly as in ``declattn run --save``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from declattn.api import Engine
from declattn.bench.e2e import kv_heavy_config, random_model
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.da.scope import Scope
from declattn.engine.controller import Forced
from declattn.engine.loader import LoadedModel
from declattn.engine.sampler import SamplingParams
from declattn.protocol.layout import Layout, Span
from declattn.show.record import block_ranges, build_record

BLOCK = 16

CHUNK_TEXTS = (
    "The lighthouse was built in 1871 by the harbour board.",
    "Mary Hale kept the light from 1903 to 1931. <b>bold</b> & <script>alert('chunk')</script>",
    "The herring catch collapsed in the 1920s.",
)

# global -> focus 2 -> global -> declined focus (unknown id) -> local -> global -> answer
TOKEN_TEXTS = (
    "Let",
    " me",
    " look",
    ".\n",
    "<focus",
    ' magic_chunks="2">',
    " The",
    " keeper",
    " was",
    " Mary",
    " Hale",
    ".",
    "</focus>",
    "\n",
    '<focus magic_chunks="9">',
    " hmm",
    "\n",
    "<local>",
    " So",
    " 1903",
    " a < b",
    "</local>",
    "<answer>",
    "Mary",
    " Hale &",
    " <script>alert('out')</script>",
    "</answer>",
)


def make_record(
    layout: Layout,
    chunk_texts: tuple[str, ...],
    token_texts: tuple[str, ...],
    *,
    block_size: int = BLOCK,
) -> dict[str, Any]:
    """A run record as ``build_record`` writes it, with reads equal to the scope's blocks."""
    rep = replay(layout, list(token_texts), block_size=block_size)
    steps = []
    for s in rep.steps:
        d = s.to_dict()
        scope = Scope(layout, s.mode, s.focus_ids)
        d["blocks_read"] = block_ranges(scope.kept_blocks(s.length, block_size))
        d["seconds"] = 0.01
        steps.append(d)
    text = "".join(token_texts)
    out = rep.to_dict()
    chunks = []
    start = 0
    for i, (span, body) in enumerate(zip(layout.chunks, chunk_texts, strict=True), start=1):
        chunks.append(
            {"id": i, "start": start, "end": start + len(body), "tokens": len(span), "text": body}
        )
        start += len(body)
    return {
        "version": 1,
        "date": "2025-01-01T00:00:00+00:00",
        "machine": {},
        "model": "synthetic",
        "arm": "da",
        "question": "Who kept the light <i>after</i> 1903?",
        "block_size": block_size,
        "prompt_tokens": layout.prompt_len,
        "output": {
            "text": text,
            "answer": "Mary Hale & <script>alert('out')</script>",
            "finish_reason": "answer",
            "token_texts": list(token_texts),
        },
        "declarations": out["declarations"],
        "steps": steps,
        "totals": out["totals"],
        "by_mode": out["by_mode"],
        "timings": {"prefill_seconds": 0.1, "decode_seconds": 0.2},
        "layout": layout.to_dict(),
        "chunks": chunks,
        "prompt_style": "inline",
    }


SMALL_LAYOUT = Layout(
    prompt_len=400,
    sink=Span(0, 16),
    chunks=(Span(20, 120), Span(128, 250), Span(256, 360)),
    question=Span(364, 400),
)


@pytest.fixture
def record() -> dict[str, Any]:
    return make_record(SMALL_LAYOUT, CHUNK_TEXTS, TOKEN_TEXTS)


FIND_CONTEXT = "\n\n".join(
    (
        "The lighthouse on Gull Point was built in 1871 by the harbour board, of granite "
        "quarried on the island, and its lamp burned whale oil until the 1890s when "
        "paraffin came.",
        "Mary Hale kept the light from 1903 to 1931. She logged every ship, mended the lens "
        "after the storm of 1916 and trained her nephew to take the watch when she grew old.",
        "The herring catch collapsed in the 1920s. Boats left the harbour for the southern "
        "grounds, the curing sheds closed, and the board sold the quay to a shipping company.",
        "In 1958 the light was automated. A diesel generator replaced the keeper's cottage "
        "stove, and the last visitors' book, kept since 1880, went to the county museum.",
    )
)
FIND_QUESTION = "Who kept the light after 1903?"
FIND_EVIDENCE = (2,)  # the chunk that names the keeper
# an exact find on the evidence, a window find elsewhere, a find that matches nothing
FIND_TRANSCRIPT = (
    '<focus find="Mary Hale">Mary Hale kept the light.</focus>\n'
    '<focus find="board harbour">the board</focus>\n'
    '<focus find="submarine base">none</focus>\n'
    "<answer>Mary Hale</answer>"
)


@pytest.fixture(scope="session")
def find_engine(smol_tokenizer) -> Engine:
    config = kv_heavy_config(len(smol_tokenizer), 8192, layers=1, kv_heads=1, head_dim=16)
    model = random_model(config, torch.float32)
    return Engine(LoadedModel(model, config, smol_tokenizer, Path(".")), kv_tokens=8192)


def forced_record(engine: Engine, transcript: str, evidence: tuple[int, ...]) -> dict[str, Any]:
    """The run record of ``transcript`` forced through a ``focus="find"`` DA session."""
    options = DAOptions(target=48, cap=64, focus="find", constrain=False, min_context=0)
    sess = engine.session(FIND_CONTEXT, FIND_QUESTION, options=options)
    tokens = engine.tokenizer.encode(transcript, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(tokens), ignore_eos=True)
    out: list[Any] = []
    for _ in engine.stream(sess, params, result=out, controller=Forced(sess, tokens)):
        pass
    assert sess.text == transcript  # the forcing took: the record is of this transcript
    answer = out[0]  # the Answer `declattn run` would get
    return build_record(answer, model="tiny-random", question=FIND_QUESTION, evidence=evidence)


@pytest.fixture(scope="session")
def find_record_master(find_engine) -> dict[str, Any]:
    return forced_record(find_engine, FIND_TRANSCRIPT, FIND_EVIDENCE)


@pytest.fixture
def find_record(find_record_master) -> dict[str, Any]:
    """A fresh copy per test, so a test may edit it."""
    return copy.deepcopy(find_record_master)
