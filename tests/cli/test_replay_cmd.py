"""``declattn replay`` of an economy record reads under the record's own scaffold rule:
a transcript forced through a live economy session, saved as ``run --save`` saves it,
replays to the live figures, which differ from the same replay without the rule."""

from __future__ import annotations

import json
from pathlib import Path

from declattn.api import Engine
from declattn.cli import main
from declattn.da.options import DAOptions
from declattn.da.replay import replay
from declattn.engine.controller import Forced
from declattn.engine.sampler import SamplingParams
from declattn.protocol.layout import Layout
from declattn.show.record import build_record, save_record

CONTEXT = "\n\n".join(
    (
        "The lighthouse on Gull Point was built in 1871 by the harbour board, of granite "
        "quarried on the island, and its lamp burned whale oil until the 1890s.",
        "Mary Hale kept the light from 1903 to 1931. She logged every ship and mended the "
        "lens after the storm of 1916.",
        "The herring catch collapsed in the 1920s. Boats left the harbour for the southern "
        "grounds and the curing sheds closed.",
    )
)
QUESTION = "Who kept the light after 1903?"
TRANSCRIPT = '<focus find="Mary Hale"><answer>Mary Hale</answer>'


def test_replay_of_an_economy_record_applies_its_scaffold_rule(
    random_smol_model, tmp_path: Path, capsys
) -> None:
    engine = Engine(random_smol_model, kv_tokens=4096)
    options = DAOptions.economy(target=32, cap=48, constrain=False, min_context=0)
    sess = engine.session(CONTEXT, QUESTION, options=options)
    tokens = engine.tokenizer.encode(TRANSCRIPT, add_special_tokens=False)
    out: list = []
    params = SamplingParams(max_tokens=len(tokens), ignore_eos=True)
    for _ in engine.stream(sess, params, result=out, controller=Forced(sess, tokens)):
        pass
    assert sess.text == TRANSCRIPT
    record = build_record(out[0], model="tiny-random", question=QUESTION)
    path = save_record(record, tmp_path / "eco.json")
    assert record["options"]["scaffold_local"] is True
    assert main(["replay", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["totals"] == record["totals"]  # replay == live, under the record's rule
    texts = [c["text"] for c in record["chunks"]]
    plain_rule = replay(Layout.from_dict(record["layout"]), record["output"]["token_texts"],
                        block_size=record["block_size"], chunk_texts=texts)
    assert plain_rule.totals()["logical"] != record["totals"]["logical"]  # the rule mattered
    assert got["by_mode"]["local"]["steps"] > 0  # the tag's own steps read as local
