"""Does llama.cpp load a GGUF written by ``declattn export``, and what does it answer?

Run with the bench environment's Python (llama-cpp-python; ``make bench-env``), which
never imports declattn::

    declattn export --model qwen2.5-0.5b-da --gguf /tmp/qwen-da.gguf
    .venv-bench/bin/python scripts/llama_gguf_check.py /tmp/qwen-da.gguf \\
        --base ~/.cache/declattn/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

It loads each file, prints its tensor count and the DA settings the export carries
(``declattn.settings``), and greedy-decodes the same short chat prompt with each (and
the base, if given), printing the texts side by side: the export loads, and its plain
answers stay the base's (or show how the adapter changes them).
"""

from __future__ import annotations

import argparse
import json

PROMPT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "The ferry to Skerrow leaves at 7:15 am.\n\nWhen does the "
     "ferry to Skerrow leave? Answer briefly."},
]


def answer(path: str, tokens: int) -> tuple[str, dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False)
    meta = dict(llm.metadata)
    out = llm.create_chat_completion(PROMPT, max_tokens=tokens, temperature=0.0, top_k=1)
    return out["choices"][0]["message"]["content"], meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="the exported GGUF")
    p.add_argument("--base", help="the base model's GGUF, to compare against")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    text, meta = answer(args.gguf, args.tokens)
    settings = meta.get("declattn.settings")
    print(f"loaded {args.gguf}: {len(meta)} metadata fields")
    print("DA settings:", json.dumps(json.loads(settings)) if settings else "none")
    print(f"export: {text!r}")
    if args.base:
        base, _ = answer(args.base, args.tokens)
        print(f"base:   {base!r}")


if __name__ == "__main__":
    main()
