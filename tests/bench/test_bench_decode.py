"""``declattn bench decode``: the pieces it is built from, and a tiny run end to end.

No timing is asserted (the machine is shared); the checks are about what was measured:
that views shrink as the mode narrows, the counter agrees with them, both arms emit the
forced transcript, and the JSON carries every field with a plausible value.
"""

from __future__ import annotations

import json
import math

import pytest

from declattn.api.session import DASession
from declattn.bench.attn_micro import focus_ids, mode_views, synthetic_layout
from declattn.bench.decode import DecodeBenchConfig, extend_positions
from declattn.bench.transcript import (
    FACT,
    Mix,
    fact_chunk,
    forced_transcript,
    repeated_essay,
)
from declattn.cli import main
from declattn.da.options import DAOptions
from declattn.protocol.modes import Mode
from declattn.protocol.tags import TagReader


def test_synthetic_layout_views_narrow_by_mode():
    layout = synthetic_layout(65536, 2048, 16, 64)
    assert layout.n_chunks == 32 and layout.question.end == 65536
    length = 65536 + 32
    views = mode_views(layout, length, 16, 2)
    g, f, loc = (set(views[m]) for m in ("global", "focus", "local"))
    assert loc < f < g and len(g) == -(-length // 16)
    newest = (length - 1) // 16
    assert newest in loc
    assert len(views["focus_ids"]) == 2
    assert 200 < len(f) - len(loc) <= 2 * 2048 // 16 + 2
    assert focus_ids(1, 2) == (1,)


def test_planted_document_and_transcript(smol_tokenizer):
    doc = repeated_essay(smol_tokenizer, 6000)
    n = len(smol_tokenizer.encode(doc, add_special_tokens=False))
    assert doc.count(FACT) == 1 and 5000 < n < 7500
    sess = DASession(smol_tokenizer, doc, "Where?", DAOptions(constrain=False))
    k = fact_chunk(sess.chunks)
    assert FACT in sess.chunks[k - 1].text
    text = forced_transcript(smol_tokenizer, (k, k + 1), 200, Mix())
    tokens = smol_tokenizer.encode(text, add_special_tokens=False)
    assert 180 < len(tokens) < 240
    reader = TagReader(len(sess.chunks))
    modes = []
    for tok in tokens:  # a token is generated in the mode the earlier ones left
        modes.append(reader.mode)
        reader.feed(smol_tokenizer.decode([tok]))
    reader.finish()
    accepted = [d for d in reader.declarations if d.accepted]
    assert [d.kind for d in accepted][::2] == ["global", "focus", "local", "answer"]
    assert not reader.declines
    share = modes.count(Mode.GLOBAL) / len(modes)
    assert 0.22 < share < 0.32
    assert 0.3 < modes.count(Mode.FOCUS) / len(modes) < 0.5


def test_extend_positions_raises_the_limit_only_upwards():
    class L:
        pass

    from declattn.engine.models import ModelConfig

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
        "max_position_embeddings": 100,
    })
    lm, model = L(), L()
    model.config = cfg
    lm.config, lm.model = cfg, model
    assert extend_positions(lm, 50) is False and lm.config.max_position_embeddings == 100
    assert extend_positions(lm, 500) is True
    assert lm.config.max_position_embeddings == model.config.max_position_embeddings == 500


def test_config_rejects_unknown_parts():
    with pytest.raises(ValueError, match="unknown parts"):
        DecodeBenchConfig(parts=("micro", "gpu"))


def test_quick_run_end_to_end_writes_plausible_json(tmp_path, capsys):
    rc = main([
        "bench", "decode", "--quick", "--threads", "1", "--repeats", "1",
        "--contexts", "8192", "--e2e-contexts", "3000", "--smol-e2e-contexts", "",
        "--hf-contexts", "96", "--output-tokens", "24", "--out", str(tmp_path),
    ])
    assert rc == 0
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".json", ".png"]
    assert files[1].stat().st_size > 10_000
    r = json.loads(files[0].read_text())
    m = r["machine"]
    assert m["cores"] >= 1 and m["torch_threads"] == 1 and m["torch"] and m["cpu"]
    assert {e["part"] for e in r["load_average"]} == {"micro", "e2e", "hf"}

    micro = r["micro"]
    (bw,) = micro["bandwidth"].values()  # the quick run measures one thread
    assert 1e8 < bw["read_best"] < 1e13 and 1e8 < bw["copy_best"] < 1e13
    (row,) = micro["contexts"]
    c = micro["config"]
    per_token = 2 * c["n_kv_heads"] * c["head_dim"] * 2  # K + V, bf16
    assert row["bytes_per_step"]["global"] == c["n_layers"] * row["length"] * per_token
    arms = {(a["kernel"], a["mode"]): a for a in row["arms"]}
    assert {k for k, _ in arms} == {"native", "torch"}
    assert {a["threads"] for a in row["arms"]} == {1}
    for kernel in ("native", "torch"):
        assert arms[(kernel, "global")]["byte_fraction"] == 1.0
        local, focus = arms[(kernel, "local")], arms[(kernel, "focus")]
        assert local["byte_fraction"] < focus["byte_fraction"] < 0.8
    for a in row["arms"]:
        assert a["seconds_per_step"]["best"] > 0 and a["roofline_seconds_per_step"] > 0
        assert math.isfinite(a["time_over_bytes_best"]) and a["read_gbps_best"] > 0
    assert arms[("native", "global")]["speedup_over_torch"] > 0

    (run,) = r["e2e"]["runs"]
    assert run["decode_steps"] == run["output_tokens"] - 1
    assert set(run["modes"]) == {"global", "focus", "local", "answer"}
    assert abs(sum(v["share"] for v in run["modes"].values()) - 1) < 1e-9
    assert run["da_bytes"] < run["vanilla_bytes"]
    assert 0 < run["predicted_ratio_roofline"] < 1 and run["measured_ratio"] > 0
    assert run["modes"]["focus"]["da_kv_bytes"] < run["modes"]["focus"]["vanilla_kv_bytes"]
    assert run["modes"]["global"]["da_kv_bytes"] == run["modes"]["global"]["vanilla_kv_bytes"]

    (hf,) = r["hf"]["contexts"]
    for name in ("ours", "transformers"):
        assert hf[name]["new_tokens"] == 4
        assert hf[name]["prefill_tokens_per_second"] > 0
        assert hf[name]["decode_tokens_per_second"] > 0
    out = capsys.readouterr().out
    assert "vanilla" in out and "transformers" in out and "bandwidth" in out
