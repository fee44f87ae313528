"""``declattn export``: the merged GGUF it writes is the registry's ``qwen2.5-0.5b-da``
file byte for byte, and loads in our engine with its DA settings and answers from them;
and llama.cpp (the bench environment's llama-cpp-python) loads it, reads its DA settings
and answers from it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from declattn.api import Engine
from declattn.cli import main
from declattn.da.options import model_da_defaults
from declattn.engine.filehash import sha256_files
from declattn.engine.loader import conversion_dir
from declattn.engine.registry import ADAPTERS, MODELS, resolve_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTION = "When does the night ferry to Skerrow leave?"
CONTEXT = (
    "The harbour office opens at nine. Its clerk sells tickets for every boat.\n\n" * 20
    + "The night ferry to Skerrow leaves at 11:40 pm from the north pier.\n\n"
    + "Fares are paid in cash; the last bus meets the ferry on its return.\n\n" * 20
)


def _greedy(engine: Engine) -> str:
    """The DA reply, greedy (the engine's default sampling), with the model's own settings
    (DA whatever the gate expects of so short a context)."""
    options = dataclasses.replace(engine.da_defaults, min_context=0)
    return engine.answer(CONTEXT, QUESTION, options=options, max_tokens=32).text


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
def test_the_export_is_the_registry_model_and_answers_with_its_settings(
    exported: Path,
) -> None:
    """The export is the very file the registry serves as ``qwen2.5-0.5b-da`` (the same
    merge, byte for byte), so our engine reads the registry model's weights from it; it
    loads with the model's DA settings (from its GGUF metadata) and answers from them."""
    shipped = resolve_model("qwen2.5-0.5b-da")
    assert sha256_files([exported]) == sha256_files([shipped])
    ours = Engine.from_pretrained(exported)
    # Conversions go by content: the export reads the registry model's, no second copy.
    assert ours.loaded.weights_dir == conversion_dir(shipped)
    adapter = ADAPTERS["qwen2.5-0.5b-da"].directory
    assert ours.da_defaults == model_da_defaults(adapter)
    assert ours.da_defaults.focus == "find" and ours.da_defaults.target == 512
    a = _greedy(ours)
    assert "11:40" in a and '<focus find="' in a, a
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
