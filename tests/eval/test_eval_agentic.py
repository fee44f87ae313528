"""The agentic task: a transcript of tool results asked questions turn by turn.

The generator on the real SmolLM2 tokenizer; conversations on the tiny random model of
``conftest.py`` (its replies are noise, so accuracy is not what is tested here: the
conversation's bookkeeping is).
"""

from __future__ import annotations

import json

import pytest

from declattn.eval.arms import ArmSettings, parse_arms
from declattn.eval.report import markdown_table, summary_json, turn_table
from declattn.eval.runner import EvalSpec, read_rows, run_eval
from declattn.eval.tasks import TASKS, generate, resolve_tasks
from declattn.eval.tasks.agentic import TOOL, TURNS, AgenticSample, tools
from declattn.protocol.messages import render_messages, render_plain_messages

LENGTH = 2048
"""Two files of about 900 tokens: a turn's shared prefix is over 1,500 tokens, three of
the engine's 512-token prefill chunks."""


@pytest.fixture(scope="module")
def sample(task_data) -> AgenticSample:
    s = generate("agentic", task_data, LENGTH, 3)
    assert isinstance(s, AgenticSample)
    return s


def test_the_task_is_registered_as_a_conversation():
    assert resolve_tasks("agentic") == ["agentic"]
    assert TASKS["agentic"].turns == TURNS
    assert EvalSpec("m", ["agentic", "planted"], [LENGTH], ["da", "vanilla"], 2).total == (
        (TURNS + 1) * 2 * 2
    )


@pytest.mark.parametrize("length", [LENGTH, 8192])
def test_the_generator_is_deterministic_and_each_answer_is_in_one_tool_result(
    task_data, smol_tokenizer, length
):
    a = generate("agentic", task_data, length, 0)
    assert a == generate("agentic", task_data, length, 0)
    assert a.context != generate("agentic", task_data, length, 1).context
    assert len(a.turns) == TURNS and len(a.files) >= 2
    texts = [a.file_text(i) for i in range(len(a.files))]
    assert a.context == "\n\n".join(texts)
    assert len({t.question for t in a.turns}) == TURNS
    for t in a.turns:
        (answer,) = t.answers
        holding = [i for i, text in enumerate(texts) if answer.lower() in text.lower()]
        assert holding == [t.file], (t.question, answer, holding)
        lo, hi = t.evidence
        f = a.files[t.file]
        assert f.start <= lo < hi <= f.end and answer in a.context[lo:hi]
    # The transcript: each file is read by one call and comes back as its tool result.
    msgs = a.messages([])
    results = [m for m in msgs if m["role"] == "tool"]
    calls = [m["tool_calls"][0]["function"] for m in msgs if m.get("tool_calls")]
    assert [m["content"] for m in results] == texts
    assert [json.loads(c["arguments"])["path"] for c in calls] == [f.path for f in a.files]
    assert all(c["name"] == TOOL for c in calls) and msgs[-1]["content"] == a.turns[0].question
    # Sized like the other tasks: the vanilla prompt at the first question.
    n = len(render_plain_messages(smol_tokenizer, msgs, tools=tools()))
    assert abs(n - length) <= 0.05 * length


def test_later_turns_carry_earlier_replies(sample):
    replies = ["first <answer>x</answer>", "second"]
    msgs = sample.messages(replies)
    assert msgs[: len(sample.transcript())] == sample.transcript()
    tail = msgs[len(sample.transcript()) :]
    assert [(m["role"], m["content"]) for m in tail] == [
        ("user", sample.turns[0].question), ("assistant", replies[0]),
        ("user", sample.turns[1].question), ("assistant", replies[1]),
        ("user", sample.turns[2].question),
    ]
    with pytest.raises(ValueError, match="only 4 turns"):
        sample.messages(["r"] * TURNS)
    header = sample.turn_header(3)
    assert header["turn"] == 3 and header["question"] == sample.turns[2].question
    assert header["answers"] == list(sample.turns[2].answers)
    assert header["context_sha256"] == sample.context_sha256


def test_the_transcript_renders_with_the_tool_results_as_chunks(smol_tokenizer, sample):
    msgs = sample.messages(["The code is <focus magic_chunks=\"1\"> 12.<|im_end|>"])
    rp = render_messages(smol_tokenizer, msgs, tools=tools())
    by_index = {m.index: m for m in rp.messages}
    for i, m in enumerate(msgs):
        if m["role"] != "tool":
            continue
        span = by_index[i]
        assert span.kind == "chunk"
        for cid in span.chunk_ids:  # a tool result's chunks hold that result alone
            assert rp.chunks[cid - 1].messages == (i,)
        text = "".join(rp.chunks[cid - 1].text for cid in span.chunk_ids)
        assert m["content"] in text
    assert rp.tool_calls == "inline"  # SmolLM2's template drops calls: written inline
    # The vanilla render is the same conversation: identical up to the final user turn,
    # the calls inline there too, the reply's tag-like text plain text in both.
    plain = render_plain_messages(smol_tokenizer, msgs, tools=tools())
    q = rp.layout.question.start
    assert plain[:q] == rp.token_ids[:q]
    assert f'"name": "{TOOL}"' in smol_tokenizer.decode(plain)
    end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert plain.count(end) == rp.token_ids.count(end) == sum(1 for _ in msgs)
    # A follow-up extends the vanilla prompt's ids: the prefix cache can reuse all of them.
    grown = [*msgs, {"role": "assistant", "content": "12"},
             {"role": "user", "content": sample.turns[2].question}]
    assert render_plain_messages(smol_tokenizer, grown, tools=tools())[: len(plain)] == plain


def _run(engine, out, arms="vanilla,da-nm,da", **settings):
    spec = EvalSpec(
        "tiny", ["agentic"], [LENGTH], parse_arms(arms), 1,
        settings=ArmSettings(**{"max_tokens": 6, **settings}),
    )
    seen: list[tuple[str, bool]] = []
    rows = run_eval(engine, spec, out, machine={}, on_row=lambda r, res: seen.append(
        (r["key"], res)))
    return rows, seen


def test_a_run_writes_one_row_per_turn_per_arm(tiny_engine, tmp_path):
    out = tmp_path / "results.jsonl"
    rows, _ = _run(tiny_engine, out, "vanilla,da-nm,da,streaming")
    assert [(r["arm"], r["turn"]) for r in rows] == [
        (a, t) for a in ("da", "da-nm", "vanilla", "streaming") for t in range(1, TURNS + 1)
    ]
    assert len({r["key"] for r in rows}) == len(rows) == 4 * TURNS
    assert read_rows(out) == [json.loads(json.dumps(r)) for r in rows]
    bs = tiny_engine.block_size
    for r in rows:
        if r["arm"] == "streaming":
            assert "runs the arms" in r["error"] and "streaming" in r["error"]
            continue
        assert r["key"].endswith(f"|{r['turn']}") and r["header"]["turn"] == r["turn"]
        assert r["header"]["question"] in json.dumps(r["header"]["turns"])
        cached = r["timing"]["cached_prompt_tokens"]
        # Each arm's conversation starts cold on a pool of its own, then the prefix cache
        # serves every earlier turn's prompt, in whole 512-token prefill chunks.
        assert cached == 0 if r["turn"] == 1 else cached >= 1024 and cached % 512 == 0
        steps = [dict(zip(r["step_fields"], s, strict=True)) for s in r["steps"]]
        assert r["totals"]["steps"] == len(steps) == r["output"]["output_tokens"] - 1
        assert r["totals"]["logical"] == sum(s["logical"] for s in steps)
        for s in steps:  # the engine read exactly what the session's scope kept
            assert s["blocks_read"] * bs == s["physical"]
        if r["arm"] == "vanilla":
            assert all(s["logical"] == s["vanilla_logical"] for s in steps)
            assert r["evidence_chunks"] == [] and "layout" not in r
        else:
            assert r["prompt_style"] == "messages" and r["layout"]["chunks"]
            assert r["evidence_chunks"] and r["evidence_chunks"][0]
    by = {(r["arm"], r["turn"]): r for r in rows}
    for arm in ("da", "vanilla"):  # each reply joins that arm's own transcript
        for t in range(2, TURNS + 1):
            assert by[(arm, t)]["prompt_tokens"] > by[(arm, t - 1)]["prompt_tokens"]
    da1 = by[("da", 1)]  # the DA prompt adds the instruction to the same conversation
    assert da1["prompt_tokens"] > by[("vanilla", 1)]["prompt_tokens"]
    assert da1["layout"]["question"][0] < by[("vanilla", 1)]["prompt_tokens"]
    table = turn_table(rows)
    assert table is not None and table.row_count == 4 * TURNS
    md = markdown_table(rows)
    assert "Per turn of the conversation tasks" in md and "| per answer vs vanilla |" in md
    assert {(j.get("turn"), j["arm"]) for j in summary_json(rows)} >= {(1, "da"), (None, "da")}


def test_a_turn_that_does_not_fit_stops_its_conversation(tiny_engine, tmp_path):
    rows, _ = _run(tiny_engine, tmp_path / "r.jsonl", "da", max_tokens=7000)
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    assert "exceeds the model's 8192 positions" in rows[0]["error"]
    assert all("turn 1 failed, so the conversation stops" in r["error"] for r in rows[1:])


class _NoEngine:
    def __getattr__(self, name):
        raise AssertionError(f"the engine was used ({name})")


def test_resume_skips_written_turns_and_continues_the_conversation(tiny_engine, tmp_path):
    out = tmp_path / "results.jsonl"
    first, _ = _run(tiny_engine, out, "da,vanilla")
    lines = out.read_text().splitlines(keepends=True)
    keep = TURNS + 2  # every da turn, vanilla's first two
    out.write_text("".join(lines[:keep]) + lines[keep][:40])  # and a half-written line
    again, seen = _run(tiny_engine, out, "da,vanilla")
    assert [res for _, res in seen] == [True] * keep + [False] * (TURNS - 2)
    assert [r["key"] for r in again] == [r["key"] for r in first]
    for old, new in zip(first[keep:], again[keep:], strict=True):
        # The conversation went on from the replies in the file: same prompt, same reply.
        assert new["prompt_tokens"] == old["prompt_tokens"]
        assert new["output"]["text"] == old["output"]["text"]
    assert again[keep]["timing"]["cached_prompt_tokens"] == 0  # its pool starts cold
    assert again[keep + 1]["timing"]["cached_prompt_tokens"] > 0
    assert len(read_rows(out)) == 2 * TURNS
    done, seen = _run(_NoEngine(), out, "da,vanilla")
    assert all(res for _, res in seen) and len(done) == 2 * TURNS
