"""``declattn show`` end to end, and its errors for files that are not run records."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from declattn.cli import main
from declattn.show import ShowRecord, load_show_record


def _save(path, record) -> str:
    path.write_text(json.dumps(record, ensure_ascii=False))
    return str(path)


def test_show_writes_png_and_page(record, tmp_path, capsys):
    rec_path = _save(tmp_path / "run.json", record)
    out = tmp_path / "figs" / "deeper"
    assert main(["show", rec_path, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        str(out / "run.png"),
        str(out / "run.html"),
        "focus: 1 accepted (evidence not known); 1 declined (unknown chunk id)",
    ]
    img = imread(out / "run.png")
    assert img.shape[:2] == (800, 1200)
    page = (out / "run.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert 'data-chunk="2"' in page and "data:image/png;base64," in page


def test_default_folder_is_next_to_the_record(record, tmp_path, capsys):
    rec_path = _save(tmp_path / "a.json", record)
    assert main(["show", rec_path]) == 0
    assert (tmp_path / "a.png").is_file() and (tmp_path / "a.html").is_file()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such record file"),
        ("{not json", "not JSON"),
        ('{"hello": 1}', "not a DA run record (missing layout, output, block_size)"),
        ("[1, 2]", "not a DA run record"),
        ("42", "not a DA run record"),
        ("null", "not a DA run record"),
    ],
)
def test_bad_files_are_user_errors(tmp_path, capsys, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert main(["show", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("declattn: error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_out_that_is_a_file_is_a_user_error(record, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    assert main(["show", _save(tmp_path / "r.json", record), "--out", str(blocker)]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_vanilla_record_is_refused(record, tmp_path, capsys):
    for key in ("layout", "chunks"):
        del record[key]
    assert main(["show", _save(tmp_path / "v.json", record)]) == 2
    assert "not a DA run record" in capsys.readouterr().err


def test_a_request_that_ran_vanilla_says_why(record, tmp_path, capsys):
    for key in ("layout", "chunks"):
        del record[key]
    record["note"] = "ran vanilla: a context of 90 tokens is under min_context 1024"
    assert main(["show", _save(tmp_path / "v.json", record)]) == 2
    err = capsys.readouterr().err
    assert "not a DA run record (missing layout); ran vanilla: a context of 90 tokens" in err


def test_show_prints_the_focus_summary_of_a_find_record(find_record, tmp_path, capsys):
    assert main(["show", _save(tmp_path / "f.json", find_record)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[2] == "focus: 1 of 2 held the evidence; 1 declined (find phrase in no chunk)"


def test_declaration_outside_the_text_is_named(record, tmp_path, capsys):
    record["declarations"][0]["end"] = 10_000
    assert main(["show", _save(tmp_path / "d.json", record)]) == 2
    err = capsys.readouterr().err
    assert "malformed DA run record" in err and "outside the output text" in err


def test_record_fields_are_checked(record):
    record["steps"][0]["mode"] = "sideways"
    with pytest.raises(ValueError, match="malformed DA run record"):
        ShowRecord.from_dict(record)


def test_load_show_record_round_trips(record, tmp_path):
    rec = load_show_record(_save(tmp_path / "r.json", record))
    assert [c.id for c in rec.chunks] == [1, 2, 3]
    assert rec.chunks[1].span == rec.layout.chunk(2)
    assert len(rec.steps) == len(rec.token_texts) - 1
    assert [d.declined for d in rec.declines] == ["unknown chunk id"]
