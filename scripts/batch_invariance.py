"""How often greedy text depends on the batch, and what ``batch_invariant`` costs.

Runs N greedy SmolLM2 requests one at a time and then as one batch, in the engine (no
server), with ``batch_invariant`` off and on, and prints how many outputs changed and the
wall time of each run. Usage: ``python scripts/batch_invariance.py [--dtype bf16]
[--requests 32] [--tokens 24]`` (docs/server.md quotes its figures).
"""

from __future__ import annotations

import argparse
import time

from declattn.api import Engine
from declattn.engine.controller import Controller
from declattn.engine.sampler import SamplingParams


def prompts(engine: Engine, n: int) -> list[list[int]]:
    names = ["Ada", "Bram", "Cora", "Dunstan", "Elin", "Finn", "Greta", "Hugh"]
    out = []
    for i in range(n):
        chat = [{"role": "user", "content": f"Write one sentence about a keeper called "
                 f"{names[i % len(names)]}. ({i})"}]
        ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add(Controller(p), params) for p in batch]
    while engine.has_work:
        engine.step()
    return [list(s.output_ids) for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    base = Engine.from_pretrained(args.model, dtype=args.dtype)
    batch = prompts(base, args.requests)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for invariant in (False, True):
        engine = base.with_pool(64 * args.requests, prefix_caching=False,
                                batch_invariant=invariant)
        t0 = time.perf_counter()
        alone = [run(engine, [p], params)[0] for p in batch]
        t_alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        together = run(engine, batch, params)
        t_batch = time.perf_counter() - t0
        differ = sum(a != b for a, b in zip(alone, together, strict=True))
        print(f"batch_invariant={invariant}: {differ} of {args.requests} greedy outputs "
              f"differ batched vs alone; one at a time {t_alone:.1f} s, batched {t_batch:.1f} s")


if __name__ == "__main__":
    main()
