# jinfer: `make install` then `make test`; `make serve` serves the default model, `make generate` runs it once.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Python 3.12 (the GPU machine's version): python3.12 on PATH, else a pyenv install.
# (a pyenv shim may exist without a 3.12 behind it, so each candidate must actually run)
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null); do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# JAX for this machine: cuda13 or cuda12 when an NVIDIA driver answers (by the CUDA version nvidia-smi reports),
# else cpu. JAX_EXTRA=cpu|cuda12|cuda13 forces one.
JAX_EXTRA ?= $(shell nvidia-smi >/dev/null 2>&1 || { echo cpu; exit; }; \
	v=$$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1); \
	[ "$${v:-0}" -ge 13 ] && echo cuda13 || echo cuda12)
comma := ,
# Test workers (pytest-xdist): one per core, at most 4 (each holds its own JAX and compiles on its own core).
# Each file runs whole on one worker (its module-scoped engines and models are built once), the files in
# collection order (tests/conftest.py puts those with slow tests first).
PYTEST_WORKERS ?= auto
HOST ?= 127.0.0.1
PORT ?= 8000
# CPU-friendly limits for the default model (a laptop); on a GPU pass your own via SERVE_ARGS.
SERVE_ARGS ?= --max-model-len 2048 --max-num-batched-tokens 256 --max-num-seqs 32

.PHONY: install test serve generate lint fetch-model clean

install: $(VENV)/.installed fetch-model

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or set PYTHON312=/path/to/python3.12"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "jinfer: installing JAX for $(JAX_EXTRA)$(if $(filter cpu,$(JAX_EXTRA)), (no NVIDIA GPU: nvidia-smi found none),\
	 (nvidia-smi found an NVIDIA GPU)) (JAX_EXTRA=cpu|cuda12|cuda13 to choose)"
	$(PY) -m pip install -q -e ".[test$(if $(filter-out cpu,$(JAX_EXTRA)),$(comma)$(JAX_EXTRA))]"
	touch $@

fetch-model: $(VENV)/.installed
	$(PY) scripts/fetch_default_model.py

# Two runs: the kernel tests (tests/kernels), then the rest. In one run a worker died in about half of the full runs
# (3 of 6; split, 1 of 3, in the second run): a segfault or abort in libgcc's unwinder (`_Unwind_Find_FDE` under
# `__cxa_throw`) during an XLA:CPU compile or an executable's serialization (jaxlib's; also with the compilation cache
# off and with every executable kept alive), and xdist then waits for the dead worker's files until killed.
PYTEST_RUN = $(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# (Both runs always; with PYTEST_ARGS, e.g. "-k sampler" or a test file, one run as asked.)
test: install
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PYTEST_RUN) tests/kernels; k=$$?; $(PYTEST_RUN) --ignore=tests/kernels && exit $$k
else
	$(PYTEST_RUN) $(PYTEST_ARGS)
endif

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

serve: install
	$(VENV)/bin/jinfer serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

generate: install
	$(VENV)/bin/jinfer generate --chat --prompt "$(PROMPT)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
