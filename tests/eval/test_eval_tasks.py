"""Task generators: the answer sits in the chunk the sample says, the length is the one
asked for, a seed gives the same sample back, and every task's samples are pinned."""

from __future__ import annotations

import hashlib
import json

import pytest

from declattn.corpora.essays import planted_fact
from declattn.eval.sample import evidence_chunks
from declattn.eval.tasks import FAMILIES, TASKS, TaskData, generate, resolve_tasks
from declattn.protocol.prompt import render_plain
from declattn.protocol.segment import segment

LENGTH = 4096
SINGLE = [name for name, task in TASKS.items() if task.turns is None]
"""A conversation task is sized by its transcript, not by one prompt over its context
(tests/eval/test_eval_agentic.py)."""


@pytest.fixture(scope="module")
def samples(task_data):
    return {name: generate(name, task_data, LENGTH, 3) for name in TASKS}


@pytest.fixture(scope="module")
def chunked(samples, task_data):
    return {n: segment(s.context, task_data.count, 1024, 1280) for n, s in samples.items()}


@pytest.mark.parametrize("name", SINGLE)
def test_rendered_length_is_the_requested_one(name, samples, smol_tokenizer, task_data):
    s = samples[name]
    prompt = render_plain(smol_tokenizer, s.context, s.prompt_question(da=False))
    assert abs(len(prompt) - LENGTH) <= 0.05 * LENGTH
    assert abs(task_data.count(s.context) - LENGTH) <= 0.05 * LENGTH


@pytest.mark.parametrize("name", list(TASKS))
def test_answer_sits_in_the_recorded_chunks(name, samples, chunked):
    s, chunks = samples[name], chunked[name]
    ids = evidence_chunks(s, chunks)
    if s.family == "aggregation":
        assert s.evidence == ()  # spread over the whole context, by design
        return
    assert ids and all(ids)
    by_id = {c.id: c.text for c in chunks}
    # Every expected answer is inside the text of the chunks that hold the evidence.
    held = "".join(by_id[i] for group in ids for i in group)
    for answer in s.answers:
        assert answer in held or (s.scoring == "qa" and any(a in held for a in s.answers))
    # And each evidence span really is inside the chunks named for it.
    for (a, b), group in zip(s.evidence, ids, strict=True):
        span = s.context[a:b]
        joined = "".join(by_id[i] for i in group)
        assert span in joined


def test_chunk_ids_follow_the_cut(samples, task_data):
    """A needle at 80% depth lies in a later chunk than one at 20% (ids are positional)."""
    s = samples["twohop"]
    chunks = segment(s.context, task_data.count, 512, 640)
    ids = evidence_chunks(s, chunks)
    first, second = sorted(ids, key=lambda g: g[0])
    assert first[-1] < second[0]  # two different chunks: two focus blocks are needed


@pytest.mark.parametrize(
    "name", ["niah_single_noise", "niah_multikey", "vt", "qa_hotpot", "cwe", "fwe", "twohop"]
)
def test_a_seed_gives_the_same_sample(name, task_data, samples):
    again = generate(name, task_data, LENGTH, 3)
    assert again == samples[name]
    other = generate(name, task_data, LENGTH, 4)
    assert other.context != again.context


def test_answers_are_where_the_task_says(samples):
    s = samples["niah_multivalue"]
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    for (a, b), value in zip(s.evidence, s.answers, strict=True):
        assert value in s.context[a:b]
    vt = samples["vt"]
    value = vt.meta["value"]
    assert f"VAR {vt.answers[0]} = {value}." in vt.context
    for prev, name in zip(vt.answers, vt.answers[1:], strict=False):
        assert f"VAR {name} = VAR {prev}." in vt.context
    cwe = samples["cwe"]
    counts = {w: cwe.context.split().count(w) for w in cwe.answers}
    assert set(counts.values()) == {30}
    fwe = samples["fwe"]
    top = fwe.meta["top_counts"]
    assert list(top.values()) == sorted(top.values(), reverse=True)
    two = samples["twohop"]
    values = two.meta["values"]
    assert two.answers[0] in values and two.forbidden[0] in values


def test_longer_contexts_hit_their_length(task_data):
    s = generate("niah_single_essay", task_data, 32 * 1024, 0)
    assert abs(task_data.count(s.context) - 32 * 1024) <= 0.05 * 32 * 1024
    assert s.answers[0] in s.context[slice(*s.evidence[0])]


def test_task_names_and_families_resolve():
    assert resolve_tasks("qa") == ["qa_squad", "qa_hotpot"]
    assert resolve_tasks("vt,niah_single_noise,vt") == ["vt", "niah_single_noise"]
    assert set(resolve_tasks("all")) == set(TASKS)
    assert set(FAMILIES) == {"niah", "vt", "aggregation", "qa", "twohop", "planted", "agentic"}
    with pytest.raises(ValueError, match="unknown task"):
        resolve_tasks("needle")


@pytest.mark.parametrize("name", list(TASKS))
def test_answer_format_goes_to_ordinary_prompts_only(name, samples):
    s = samples[name]
    assert s.prompt_question(da=True) == s.question
    plain = s.prompt_question(da=False)
    assert plain.startswith(s.question)
    if s.answer_format:
        assert plain.endswith(s.answer_format) and s.answer_format not in s.question


FINGERPRINTS = {
    "eval": "e2a8f2864d17a70140c9babb9e6fc2e6947cebd19ea8bfd290eaf4e099ccdd71",
    "all": "36e91fb1c087ad285b93ecc887c706228192d7701586b93d39291de170f4613a",
}
"""Every task at 2 lengths x 3 seeds (header and context of each sample) and 200 planted
facts, over the SmolLM2 tokenizer. ``eval`` is what every evaluation reads: the
evaluation part of the corpora (``corpora/split.py``). ``all`` reads the corpora whole:
the samples from before the split, so the split changed the samples only by what it takes
away. A change to any generator changes these on purpose or not at all."""


@pytest.mark.parametrize("part", list(FINGERPRINTS))
def test_samples_of_every_task_are_pinned(part, smol_tokenizer):
    data = TaskData.for_tokenizer(smol_tokenizer, part)
    h = hashlib.sha256()
    seen = set()
    for name in TASKS:
        for length in (2048, 4096):
            for seed in (0, 1, 2):
                s = generate(name, data, length, seed)
                h.update(json.dumps(s.header(), sort_keys=True, default=repr).encode())
                h.update(s.context.encode())
                seen.add(s.task)
    for seed in range(200):
        h.update(repr(planted_fact(seed)).encode())
    assert seen == set(TASKS)
    assert h.hexdigest() == FINGERPRINTS[part]
