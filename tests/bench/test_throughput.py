"""``declattn bench throughput`` and ``bench serve``: what they compute from what they
measure (no timing is asserted: the machine is shared), and a tiny in-process run."""

from __future__ import annotations

import pytest
import torch

from declattn.bench.e2e import engine_over, kv_heavy_config, random_model
from declattn.bench.http_load import Stream, pct, summary
from declattn.bench.machine import BandwidthProbe
from declattn.bench.soak import rss_growth
from declattn.bench.throughput import InProcessConfig, document, measure


def test_summary_counts_the_window_where_every_stream_decodes() -> None:
    a = Stream(0.0, [1.0, 2.0, 3.0, 4.0], completion_tokens=4)
    b = Stream(0.0, [2.5, 3.5, 4.5, 5.5, 6.5], completion_tokens=10)  # two tokens a chunk
    s = summary([a, b, Stream(0.0, error="boom")])
    assert s["completion_tokens"] == 14 and s["errors"] == ["boom"]
    assert s["wall_seconds"] == 6.5 and s["tokens_per_second"] == pytest.approx(14 / 6.5)
    # from 2.5 (both have begun) to 4.0 (the first ends): a's 3.0, 4.0; b's 3.5
    assert s["steady_tokens_per_second"] == pytest.approx((1 + 1 + 2) / 1.5)
    assert s["ttft_p50"] == pytest.approx(1.75) and s["ttft_max"] == 2.5
    assert s["gap_max"] == 1.0 and pct([3.0], 99) == 3.0 and pct([], 50) is None


def test_rss_growth_is_measured_after_the_settling_time() -> None:
    samples = [(0.0, 700.0), (100.0, 2200.0), (300.0, 2400.0), (900.0, 2500.0)]
    assert rss_growth(samples) == pytest.approx(2500 / 2400 - 1)
    assert rss_growth(samples[:3]) is None  # one sample after settling says nothing


def test_config_refuses_a_da_arm_without_real_prefill() -> None:
    with pytest.raises(ValueError, match="real_prefill"):
        InProcessConfig(arms=("vanilla", "da"))
    with pytest.raises(ValueError, match="unknown arms"):
        InProcessConfig(arms=("turbo",))


def test_documents_share_no_prefix(smol_tokenizer) -> None:
    a, b = (smol_tokenizer.encode(document(smol_tokenizer, 3000, i)) for i in (1, 2))
    assert a[:8] != b[:8]
    assert 2400 < len(a) < 3600


def test_a_tiny_in_process_run_measures_a_focus_against_vanilla(smol_tokenizer) -> None:
    """Two requests over 5,000-token documents (three chunks), a random KV-heavy model:
    the focus arm is timed only in focus and reads fewer KV bytes a step than vanilla."""
    config = kv_heavy_config(len(smol_tokenizer), 8192, layers=1, kv_heads=2, head_dim=32)
    engine = engine_over(random_model(config, dtype=torch.float32), smol_tokenizer)
    cfg = InProcessConfig(contexts=(5000,), concurrency=(2,), warmup=1, steps=4, block=2)
    logs: list[str] = []
    row = measure(engine, 5000, 2, cfg, BandwidthProbe(1 << 20), logs.append)
    van, foc = row["arms"]["vanilla"], row["arms"]["da-focus"]
    assert van["timed_steps"] == foc["timed_steps"] == 4
    assert foc["in_focus"] is True
    assert 0 < foc["kv_bytes_per_step"] < 0.8 * van["kv_bytes_per_step"]
    assert row["weight_bytes_per_step"] > 0 and van["tokens_per_second"] > 0
    assert len(logs) == 2 and "synthetic" in logs[0]


def test_the_http_part_runs_a_real_server_on_the_threads_asked(tmp_path) -> None:
    """``--parts http`` end to end on smollm2: a fresh ``declattn serve`` (prefix cache in
    memory only), two streamed requests over distinct documents, each writing max_tokens
    (``ignore_eos``)."""
    import argparse

    from declattn.bench import throughput_report
    from declattn.bench.throughput_http import HttpConfig

    with pytest.raises(ValueError, match="a number of threads"):
        HttpConfig(threads=0)
    p = argparse.ArgumentParser()
    throughput_report.add_arguments(p, lambda t: tuple(int(x) for x in t.split(",")))
    args = p.parse_args(["--model", "smollm2-135m", "--parts", "http", "--contexts", "1000",
                         "--concurrency", "2", "--arms", "declattn-vanilla",
                         "--max-tokens", "3", "--threads", "1", "--out", str(tmp_path)])
    result = throughput_report.run(args, lambda _m: None)
    part = result["parts"]["http"]
    assert part["config"]["threads"] == 1
    (row,) = part["rows"]
    assert row["errors"] == [] and row["requests"] == 2
    assert row["completion_tokens"] == 6 and min(row["prompt_tokens"]) > 1000
    assert (tmp_path / "throughput.json").is_file()


def test_real_prefills_leave_every_request_decoding_in_the_timed_steps(smol_tokenizer) -> None:
    """With ``real_prefill`` the prompts prefill one after another; the timed steps still
    carry all of them (each step reads both requests' KV, as with synthetic K/V)."""
    config = kv_heavy_config(len(smol_tokenizer), 4096, layers=1, kv_heads=2, head_dim=32)
    engine = engine_over(random_model(config, dtype=torch.float32), smol_tokenizer)
    rows = {}
    for real in (False, True):
        cfg = InProcessConfig(contexts=(3000,), concurrency=(2,), arms=("vanilla",), warmup=1,
                              steps=4, block=2, real_prefill=real)
        rows[real] = measure(engine, 3000, 2, cfg, BandwidthProbe(1 << 20), lambda _m: None)
    real, synthetic = (rows[x]["arms"]["vanilla"]["kv_bytes_per_step"] for x in (True, False))
    assert real == pytest.approx(synthetic, rel=0.05)
