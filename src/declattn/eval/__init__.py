"""The evaluation harness: accuracy against reads, for DA and the baselines.

- ``tasks/``: seeded generators (needles, variable tracking, word extraction, QA over
  SQuAD and HotpotQA, a two-hop comparison), sized in the served tokenizer's tokens;
- ``arms``: vanilla, DA-nm, DA, DA constrained, StreamingLLM and Quest-style top-k, all
  in one engine (``baselines`` holds the two sparse controllers); arms over one prompt
  share its prefill through the engine's prefix cache;
- ``rows``, ``runner``: one JSONL row per response, resumable;
- ``scoring``, ``metrics``, ``report``, ``plots``, ``judge``: what the rows say;
- ``roofline``, ``accelerators``: reads turned into projected decode time.
"""
