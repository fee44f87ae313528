"""Scoring and per-response metrics: string match, EM/F1, the two-hop choice rule, format
failures, focus success; all computed from a results row alone."""

from __future__ import annotations

import pytest

from declattn.eval.metrics import row_metrics, summarize
from declattn.eval.rows import STEP_FIELDS
from declattn.eval.scoring import exact_match, f1, match_all, normalize, score


def test_ruler_string_match_is_the_fraction_present():
    assert match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert match_all("Only 123 here", ["123", "456"]) == 0.5
    assert match_all("ALPHA-beta", ["alpha-BETA"]) == 1.0  # case-insensitive


def test_squad_exact_match_and_f1():
    assert normalize("The  Eiffel, tower!") == "eiffel tower"
    assert exact_match("the Eiffel Tower", ["Eiffel Tower", "Paris"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert f1("Eiffel", ["Eiffel Tower"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert f1("nothing", ["Eiffel Tower"]) == 0.0


def test_qa_accuracy_is_part_match_and_carries_em_f1():
    s = score("It was the Eiffel Tower.", {"answers": ["Eiffel Tower"], "scoring": "qa"})
    assert s.accuracy == 1.0 and s.exact_match == 0.0 and 0 < s.f1 < 1


def test_choice_needs_the_winner_and_not_the_loser():
    h = {"answers": ["Wren"], "forbidden": ["Halcyon"], "scoring": "choice"}
    assert score("Wren", h).accuracy == 1.0
    assert score("the Wren, not the Halcyon", h).accuracy == 0.0
    assert score("Halcyon", h).accuracy == 0.0


def test_no_answer_is_a_format_failure_and_wrong():
    s = score(None, {"answers": ["7"], "scoring": "match_all"})
    assert s.accuracy == 0.0 and s.format_failure
    s = score(None, {"answers": ["x"], "scoring": "qa"})
    assert s.exact_match == 0.0 and s.f1 == 0.0 and s.format_failure
    assert not score("", {"answers": ["7"]}).format_failure


def _row(arm, answer, declarations, steps, family="niah", evidence=((3,),)):
    logical = sum(s[3] for s in steps)
    return {
        "arm": arm,
        "family": family,
        "model": "m",
        "length": 4096,
        "header": {"answers": ["4711"], "scoring": "match_all"},
        "evidence_chunks": [list(e) for e in evidence],
        "output": {
            "answer": answer,
            "text": "",
            "finish_reason": "answer",
            "output_tokens": len(steps) + 1,
        },
        "declarations": declarations,
        "declines": [d for d in declarations if d["declined"]],
        "step_fields": list(STEP_FIELDS),
        "steps": steps,
        "totals": {
            "steps": len(steps),
            "logical": logical,
            "physical": logical,
            "vanilla_logical": 100 * len(steps),
            "vanilla_physical": 100 * len(steps),
        },
        "by_mode": {
            "global": {"steps": 1, "logical": 100, "physical": 100},
            "focus": {"steps": 2, "logical": 40, "physical": 40},
            "local": {"steps": 0, "logical": 0, "physical": 0},
        },
        "timing": {"wall_seconds": 1.0, "decode_seconds": 0.5},
    }


def _decl(kind, ids=(), declined=None):
    return {
        "kind": kind,
        "focus_ids": list(ids),
        "declined": declined,
        "tag": "",
        "start": 0,
        "end": 0,
        "mode": kind,
    }


def _step(mode, logical):
    return [mode, [], 100, logical, logical, 100, 100, None, None, None, None]


def test_focus_success_global_share_and_declines():
    decls = [
        _decl("global"),
        _decl("focus", (9,), "unknown chunk id"),
        _decl("focus", (3,)),
        _decl("focus", (5,)),
    ]
    steps = [_step("global", 100), _step("focus", 20), _step("focus", 20)]
    m = row_metrics(_row("da", "it is 4711", decls, steps))
    assert m.accuracy == 1.0
    assert (m.focus_attempts, m.focus_accepted, m.focus_on_answer) == (3, 2, 1)
    assert m.focus_covered is True
    assert m.declines == 1
    assert m.global_share == pytest.approx(1 / 3)
    assert m.saving == pytest.approx(1 - 140 / 300)
    assert m.logical_by_mode == {"global": 100, "focus": 40}
    two = row_metrics(_row("da", "x", decls, steps, evidence=((3,), (7,))))
    assert two.focus_covered is False  # the second fact's chunk was never focused
    missing = _row("da", None, decls, steps)
    missing["output"]["text"] = "no tags, but 4711"
    m = row_metrics(missing)
    assert m.accuracy == 0.0 and m.format_failure and m.lenient_accuracy == 1.0
    van = row_metrics(_row("vanilla", "4711", [], [_step("global", 100)]))
    assert van.focus_attempts is None and van.global_share is None


def test_accuracy_is_macro_over_families():
    steps = [_step("global", 100)]
    rows = [_row("vanilla", "4711", [], steps, family="niah") for _ in range(3)]
    rows.append(_row("vanilla", "no", [], steps, family="qa"))
    s = summarize(rows)
    assert s.by_family == {"niah": 1.0, "qa": 0.0}
    assert s.accuracy == 0.5  # not 3/4: each family counts once
    assert s.logical_by_mode == {"global": 100, "focus": 40}
