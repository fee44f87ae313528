#!/usr/bin/env bash
# The prepared GPU check (docs/vllm.md, "GPU check"): one command, under 10 minutes on
# one GPU. Prints PASS / FAIL / SKIP for each check with its figures or its reason, then
# a summary; exits 1 when a check fails (with --strict, also when one was skipped).
#
#   scripts/gpu_check.sh [--model DIR_OR_NAME] [--strict] [--only 1,4]
#
# PYTHON picks the interpreter (default: .venv-vllm, then .venv, then python3): it needs
# torch with CUDA for checks 1-3 and 5, and vLLM 0.32 for check 5. The checkout's src/ is
# put on the path, so declattn need not be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for candidate in .venv-vllm/bin/python .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
    done
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec timeout 590 "$PY" scripts/gpu_check.py "$@"
