"""``declattn export``: the merged GGUF it writes loads in our engine and answers as the
registry's ``qwen2.5-0.5b-da`` does, greedy, token for token; and llama.cpp (the bench
environment's llama-cpp-python) loads it, reads its DA settings and answers from it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from declattn.api import Engine
from declattn.cli import main
from declattn.engine.registry import ADAPTERS, MODELS, resolve_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTION = "When does the night ferry to Skerrow leave?"
CONTEXT = (
    "The harbour office opens at nine. Its clerk sells tickets for every boat.\n\n" * 20
    + "The night ferry to Skerrow leaves at 11:40 pm from the north pier.\n\n"
    + "Fares are paid in cash; the last bus meets the ferry on its return.\n\n" * 20
)


def _greedy(engine: Engine) -> str:
    """The DA reply, greedy (the engine's default sampling)."""
    return engine.answer(CONTEXT, QUESTION, max_tokens=24).text


BENCH_PYTHON = Path(__file__).resolve().parents[2] / ".venv-bench" / "bin" / "python"
"""The bench environment (``make bench-env``): llama-cpp-python, and no declattn."""
LLAMA_ANSWER = """
import json, sys
import llama_cpp
prompt = [{"role": "user", "content": "The ferry to Skerrow leaves at 7:15 am.\\n\\n"
           "When does the ferry to Skerrow leave? Answer briefly."}]
out = {}
for path in sys.argv[1:]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False)
    reply = llm.create_chat_completion(prompt, max_tokens=24, temperature=0.0, top_k=1)
    out[path] = {"text": reply["choices"][0]["message"]["content"],
                 "settings": llm.metadata.get("declattn.settings")}
print(json.dumps(out))
"""
"""Run by the bench environment's Python: each GGUF's greedy plain answer to a question
its prompt answers, and the DA settings its metadata carries."""

needs_model = pytest.mark.skipif(not MODELS["qwen2.5-0.5b-da"].installed(),
                                 reason="qwen2.5-0.5b's packages are not installed")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "qwen-da.gguf"
    assert main(["export", "--model", "qwen2.5-0.5b-da", "--gguf", str(out)]) == 0
    return out


def _llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be run here, or None."""
    if not BENCH_PYTHON.is_file():
        return f"no {BENCH_PYTHON}: build the bench environment with `make bench-env`"
    probe = subprocess.run([str(BENCH_PYTHON), "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode:
        return f"{BENCH_PYTHON} cannot import llama_cpp: rebuild it with `make bench-env`"
    return None


@needs_model
def test_the_export_answers_as_the_registry_model(exported: Path) -> None:
    ours = Engine.from_pretrained(exported)
    shipped = Engine.from_pretrained("qwen2.5-0.5b-da")
    assert ours.da_defaults == shipped.da_defaults
    assert ours.da_defaults.focus == "find" and ours.da_defaults.target == 512
    a, b = _greedy(ours), _greedy(shipped)
    assert a == b and "11:40" in a, (a, b)
    meta = json.loads((ours.loaded.weights_dir / "declattn.json").read_text())
    assert meta["da"]["scaffold_local"] is True


@needs_model
def test_llama_cpp_loads_the_export_and_answers_from_it(exported: Path) -> None:
    missing = _llama_cpp_missing()
    if missing:
        pytest.skip(missing)
    base = str(resolve_model("qwen2.5-0.5b"))
    run = subprocess.run([str(BENCH_PYTHON), "-c", LLAMA_ANSWER, str(exported), base],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    ours, theirs = answers[str(exported)], answers[base]
    shipped = json.loads((ADAPTERS["qwen2.5-0.5b-da"].directory / "declattn.json").read_text())
    assert json.loads(ours["settings"]) == shipped
    assert theirs["settings"] is None  # the base carries none: the export added them
    # The merged weights still answer a plain question from the prompt, as the base does.
    assert "7:15" in theirs["text"] and "7:15" in ours["text"], (ours, theirs)
