"""llama.cpp (through llama-cpp-python) as a long-lived worker of ``bench peers``.

Run by the bench environment's Python (``make bench-env``), not imported by declattn: it
imports nothing of ours, so llama-cpp-python never has to share an environment (or a
process) with torch. It reads one JSON request per line on stdin and writes one JSON
answer per line on stdout. Token ids come from the driver, so both engines see the same
prompt; nothing here tokenizes or samples (the driver's tokens are fed teacher-forced,
and llama.cpp computes the last token's logits at every step, as it does when serving).

Requests: ``{"cmd": "load", "model": path, "n_ctx": n, "flash_attn": [true, false]}``;
``{"cmd": "prefill", "fa": bool, "threads": t, "tokens": [...]}`` (from an empty cache);
``{"cmd": "decode", "fa": bool, "threads": t, "tokens": [...]}`` (one token per step,
each step timed); ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import json
import sys
import time


def _set_threads(llm, threads: int) -> None:
    import llama_cpp

    llama_cpp.llama_set_n_threads(llm._ctx.ctx, threads, threads)


def main() -> None:
    import llama_cpp

    engines: dict[bool, object] = {}
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        try:
            if cmd == "load":
                for fa in req["flash_attn"]:
                    engines[fa] = llama_cpp.Llama(
                        model_path=req["model"], n_ctx=req["n_ctx"], flash_attn=fa,
                        n_threads=req.get("threads", 1), verbose=False,
                    )
                info = llama_cpp.llama_print_system_info().decode()
                answer = {"version": llama_cpp.__version__, "system": info}
            elif cmd == "prefill":
                llm = engines[req["fa"]]
                _set_threads(llm, req["threads"])
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(req["tokens"])
                answer = {"seconds": time.perf_counter() - t0, "n_tokens": llm.n_tokens}
            elif cmd == "decode":
                llm = engines[req["fa"]]
                _set_threads(llm, req["threads"])
                times = []
                for tok in req["tokens"]:
                    t0 = time.perf_counter()
                    llm.eval([tok])
                    times.append(time.perf_counter() - t0)
                answer = {"seconds": times, "n_tokens": llm.n_tokens}
            elif cmd == "quit":
                return
            else:
                answer = {"error": f"unknown command {cmd!r}"}
        except Exception as e:  # reported to the driver, which raises it there
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
