"""Rich tables for a ``bench decode`` result (the JSON holds every figure; these are the
ones a reader compares)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (
        f"{m['cpu']} | {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} "
        f"threads | {m['date']} | load average {m['load_average']} at start, "
        f"{m.get('load_average_end')} at end"
    )


def micro_table(micro: dict[str, Any]) -> Table:
    c = micro["config"]
    bws = ", ".join(
        f"{t} thread{'s' if t != '1' else ''} {bw['read_best'] / 1e9:.1f}"
        for t, bw in micro["bandwidth"].items()
    )
    hot = "; ".join(
        f"{kn} hot in cache: "
        + ", ".join(f"{t} thr {v / 1e9:.1f}" for t, v in per.items())
        for kn, per in micro.get("hot_cache_bytes_per_second", {}).items()
    )
    t = Table(
        title=(
            f"decode attention per step: {c['n_layers']} layers of {c['n_heads']}q/"
            f"{c['n_kv_heads']}kv heads x {c['head_dim']}, {c['dtype']}; read bandwidth "
            f"(GB/s, same run): {bws}" + (f"; {hot}" if hot else "")
        )
    )
    for col in ("context", "mode", "kernel", "threads", "blocks", "MiB/step", "ms best",
                "ms median", "cpu ms", "GB/s", "cpu GB/s", "roofline ms", "time/roofline",
                "cpu/roofline", "time/bytes", "x 1 thread", "x torch"):
        t.add_column(col, justify="right")
    for row in micro["contexts"]:
        for a in row["arms"]:
            t.add_row(
                f"{row['context']:,}",
                a["mode"],
                a["kernel"],
                str(a["threads"]),
                str(row["blocks"][a["mode"]]),
                f"{a['bytes_per_step'] / 2**20:.1f}",
                _ms(a["seconds_per_step"]["best"]),
                _ms(a["seconds_per_step"]["median"]),
                _ms(a["cpu_seconds_per_step"]["best"]),
                f"{a['read_gbps_best']:.1f}",
                f"{a['cpu_read_gbps_best']:.1f}",
                _ms(a["roofline_seconds_per_step"]),
                f"{a['time_over_roofline_best']:.2f}",
                f"{a['cpu_time_over_roofline_best']:.2f}",
                "" if a["mode"] == "global" else f"{a['time_over_bytes_best']:.2f}",
                f"{a['speedup_over_1_thread']:.2f}" if "speedup_over_1_thread" in a else "",
                f"{a['speedup_over_torch']:.1f}" if a["kernel"] != "torch"
                and "speedup_over_torch" in a else "",
            )
    return t


def e2e_table(e2e: dict[str, Any]) -> Table:
    t = Table(title="forced DA transcript: DA masking vs vanilla (same prompt, same output)")
    for col in ("model", "prompt", "steps", "global share", "attn share", "DA s", "vanilla s",
                "DA/vanilla", "cpu DA/vanilla", "roofline"):
        t.add_column(col, justify="right")
    for r in e2e["runs"]:
        t.add_row(
            r["model"],
            f"{r['prompt_tokens']:,}",
            str(r["decode_steps"]),
            f"{r['modes'].get('global', {}).get('share', 0.0):.0%}",
            f"{r['attention_share_of_vanilla_step']:.0%}",
            f"{r['da_decode_seconds']:.2f}",
            f"{r['vanilla_decode_seconds']:.2f}",
            f"{r['measured_ratio']:.3f}",
            f"{r['measured_cpu_ratio']:.3f}",
            f"{r['predicted_ratio_roofline']:.3f}",
        )
    return t


def hf_table(hf: dict[str, Any]) -> Table:
    t = Table(title=f"{hf['model']} {hf['dtype']}: declattn vs transformers {hf['transformers']}")
    for col in ("context", "engine", "prefill tok/s", "decode tok/s", "decode ms/token median"):
        t.add_column(col, justify="right")
    for r in hf["contexts"]:
        for name in ("ours", "transformers"):
            e = r[name]
            t.add_row(
                f"{r['context']:,}",
                "declattn" if name == "ours" else "transformers",
                f"{e['prefill_tokens_per_second']:.0f}",
                f"{e['decode_tokens_per_second']:.2f}",
                _ms(e["decode_seconds_per_token_median"]),
            )
    return t


def tables(result: dict[str, Any]) -> list[Table]:
    out = []
    if "micro" in result:
        out.append(micro_table(result["micro"]))
    if "e2e" in result:
        out.append(e2e_table(result["e2e"]))
    if "hf" in result:
        out.append(hf_table(result["hf"]))
    return out
