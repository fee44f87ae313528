"""Focus diagnostics as ``show`` reads them: from a real find session's record, from an
older record that has only its declarations, and the one-line summary."""

from __future__ import annotations

import pytest

from declattn.show import ShowRecord


def test_a_find_record_reads_every_focus(find_record):
    rec = ShowRecord.from_dict(find_record)
    assert rec.focus_form == "find"
    assert rec.evidence_chunks == (2,)
    got = [(f.by, f.phrase, f.match, f.focus_ids, f.declined, f.holds_evidence) for f in rec.focus]
    assert got == [
        ("find", "Mary Hale", "exact", (2,), None, True),
        ("find", "board harbour", "window", (1,), None, False),
        ("find", "submarine base", None, (), "find phrase in no chunk", False),
    ]
    # each focus is tied to its tag in the output text
    for f in rec.focus:
        assert rec.text[f.start : f.end] == f.tag
        assert f.tag.startswith("<focus find=")


def test_the_resolved_chunk_holds_the_phrase(find_record):
    rec = ShowRecord.from_dict(find_record)
    chunks = {c.id: c.text for c in rec.chunks}
    exact = rec.focus[0]
    assert exact.phrase in chunks[exact.focus_ids[0]]
    assert all(exact.phrase not in t for i, t in chunks.items() if i != exact.focus_ids[0])


def test_a_record_without_focus_diagnostics_reads_its_declarations(record):
    assert "focus" not in record and "focus_form" not in record
    rec = ShowRecord.from_dict(record)
    assert rec.focus_form is None and rec.evidence_chunks is None and rec.note is None
    got = [(f.by, f.phrase, f.match, f.focus_ids, f.declined, f.holds_evidence) for f in rec.focus]
    assert got == [
        ("ids", None, None, (2,), None, None),
        ("ids", None, None, (), "unknown chunk id", None),
    ]
    assert rec.focus_summary() == (
        "focus: 1 accepted (evidence not known); 1 declined (unknown chunk id)"
    )


def test_evidence_chunks_alone_decide_holds_evidence(record):
    record["evidence_chunks"] = [3]
    rec = ShowRecord.from_dict(record)
    assert rec.focus[0].holds_evidence is False
    assert rec.focus_summary().startswith("focus: 0 of 1 held the evidence")
    record["evidence_chunks"] = [2, 3]
    assert ShowRecord.from_dict(record).focus_summary().startswith("focus: 1 of 1 held")


def test_summary_of_a_find_record(find_record):
    assert ShowRecord.from_dict(find_record).focus_summary() == (
        "focus: 1 of 2 held the evidence; 1 declined (find phrase in no chunk)"
    )


def test_summary_with_partly_known_evidence(find_record):
    del find_record["evidence_chunks"]
    del find_record["focus"][1]["holds_evidence"]
    assert ShowRecord.from_dict(find_record).focus_summary() == (
        "focus: 1 of 1 held the evidence; 1 not known; 1 declined (find phrase in no chunk)"
    )


def test_summary_without_any_focus(find_record):
    find_record["focus"] = []
    assert ShowRecord.from_dict(find_record).focus_summary() == "focus: none declared"


def test_a_focus_that_matches_no_declaration_is_named(find_record):
    find_record["focus"][0]["start"] = 3
    with pytest.raises(ValueError, match="focus at character 3 matches no focus declaration"):
        ShowRecord.from_dict(find_record)


def test_note_is_read(find_record):
    find_record["note"] = "something the engine wants said"
    assert ShowRecord.from_dict(find_record).note == "something the engine wants said"
