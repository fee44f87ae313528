"""The GGUF kernel's A/Bs: rows regrouped or in the file's layout, merged or separate calls.

Q5_0 and Q8_0 regrouped as the loader does (by sixteen rows with AVX-512 VNNI, by eight
on AVX2) against the file's own layout, and, where it is sixteen, against eight; and
q/k/v and gate/up merged into one call each against separate calls.

The layouts of every GGUF matrix are held in one process (copies of the loaded layers,
``GGUFLinear(..., group_rows=-1)`` for the file's layout) and timed in turns, so that all
see the same minutes and neighbours on a noisy machine. Where more than one format is
regrouped, there is also an arm per format with only that format in the file's layout
(the others regrouped): what regrouping that format alone gives.

- ``matrices``: one decode row through all the model's GGUF matrices in the model's
  order (a decode step's weights), best and median of ``--passes``;
- ``calls``: the same weights through the merged layers (four calls a layer) and through
  the seven separate ones, alternated the same way;
- ``--step``: a whole 4K-token vanilla decode step of the engine (``declattn bench
  peers``'s prompt, KV from ``prefill_synthetic``), each layout put in the model in
  turn, the median of six steps per block, best and median over eight blocks.

Usage: ``python scripts/gguf_layout_ab.py [--model qwen2.5-0.5b] [--threads 1] [--step]``
(docs/engine.md quotes it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from gguf import GGMLQuantizationType

from declattn.api import Engine
from declattn.bench import peers
from declattn.engine.quant.fuse import fuse_gguf_projections
from declattn.engine.quant.kernel import REGROUPED
from declattn.engine.quant.linear import GGUFLinear


def copies(
    layers: dict[str, GGUFLinear], file_types: set[int], group_rows: int = 0
) -> dict[str, GGUFLinear]:
    """Copies of the layers (bias shared), those of the ggml ``file_types`` in the file's
    layout and the others regrouped as the loader does (``group_rows`` 0), or by that many
    rows (8 or 16). Every arm is such a copy, the
    regrouped one too: the loaded layers themselves ran 1-3 ms slower over qwen2.5-0.5b's
    matrices than two fresh copies of the same layout (where their pages lie, it seems),
    which an A/B against them would have put down to the layout."""
    out = {}
    for name, m in layers.items():
        rows = -1 if m.ggml_type in file_types else group_rows
        out[name] = GGUFLinear(m.file_blocks(), m.ggml_type, m.in_features, group_rows=rows)
        out[name].bias = m.bias
    return out


def put(model: torch.nn.Module, layers: dict[str, GGUFLinear]) -> None:
    """Put ``layers`` in the model, and merge q/k/v and gate/up again from them."""
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    fuse_gguf_projections(model)


def report(name: str, times: list[float], nbytes: int | None = None) -> None:
    best, med = min(times), statistics.median(times)
    rate = f" ({nbytes / best / 1e9:.1f} / {nbytes / med / 1e9:.1f} GB/s)" if nbytes else ""
    print(f"{name:>32}: best {best * 1e3:6.1f} ms, median {med * 1e3:6.1f} ms{rate}")


def matrices(layouts: dict[str, dict[str, GGUFLinear]], passes: int) -> None:
    xs = {}
    for layers in layouts.values():
        for m in layers.values():
            xs.setdefault(m.in_features, torch.randn(1, m.in_features, dtype=torch.bfloat16))
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(passes + 1):
        for name, layers in layouts.items() if i % 2 else reversed(layouts.items()):
            t0 = time.perf_counter()
            for m in layers.values():
                m(xs[m.in_features])
            if i:  # the first pass warms both
                times[name].append(time.perf_counter() - t0)
    nbytes = sum(m.blocks.numel() for m in next(iter(layouts.values())).values())
    for name, ts in times.items():
        report(f"matrices, {name}", ts, nbytes)


def calls(model: torch.nn.Module, passes: int) -> None:
    separate, merged = [], []
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        separate += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if a.qkv_proj is None or m.gate_up_proj is None:
            raise SystemExit(f"{type(layer).__name__}: q/k/v or gate/up were not merged")
        merged += [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    head = model.lm_head if model.lm_head is not None else model.tied_head
    kinds = {f"{len(separate) + 1} separate calls": [*separate, head],
             f"{len(merged) + 1} merged calls": [*merged, head]}
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in separate}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for i in range(passes + 1):
        for name, mods in kinds.items() if i % 2 else reversed(kinds.items()):
            t0 = time.perf_counter()
            for m in mods:
                m(xs[m.in_features])
            if i:
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        report(name, ts)


def step(engine: Engine, layouts: dict[str, dict[str, GGUFLinear]], threads: int) -> None:
    cfg = peers.PeersConfig(contexts=(4096,), threads=(threads,), repeats=12)
    sessions, tokens, tag_len = peers._prompt(engine, 4096, cfg)
    arm = peers._declattn_arm(engine, "vanilla", sessions["vanilla"], tokens, cfg)
    peers._prefill(arm, synthetic=True, seed=0)
    for _ in range(tag_len + 2):
        arm.engine.step()
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(8):
        for name, layers in layouts.items() if i % 2 else reversed(layouts.items()):
            put(engine.loaded.model, layers)
            steps = []
            for _ in range(6):
                t0 = time.perf_counter()
                arm.engine.step()
                steps.append(time.perf_counter() - t0)
            times[name].append(statistics.median(steps))
    for name, ts in times.items():
        report(f"4K step, {name}", ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--step", action="store_true", help="also time a 4K vanilla decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    model = engine.loaded.model
    loaded = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    regrouped = Counter(
        GGMLQuantizationType(m.ggml_type).name
        for m in loaded.values()
        if m.kernel_type != m.ggml_type
    )
    print(f"{args.model}: {len(loaded)} GGUF matrices, regrouped {dict(regrouped) or 'none'}, "
          f"{args.threads} thread(s)")
    layouts = {"regrouped": copies(loaded, set())}
    if any(REGROUPED.get(m.kernel_type, ("", 0))[1] == 16 for m in loaded.values()):
        layouts["regrouped by eight rows"] = copies(loaded, set(), group_rows=8)
    if len(regrouped) > 1:
        for name in sorted(regrouped):
            layouts[f"{name} in file layout"] = copies(loaded, {GGMLQuantizationType[name]})
    layouts["file layout"] = copies(loaded, {m.ggml_type for m in loaded.values()})
    matrices(layouts, args.passes)
    calls(model, args.passes)
    if args.step:
        step(engine, layouts, args.threads)
    put(model, loaded)


if __name__ == "__main__":
    main()
