# transformers-lookahead: `make bench` runs the benchmark on the real model, `make test` the test suite.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel is kept when torch is already installed; otherwise installing it first stops pip from pulling a
# multi-GB CUDA build on a machine without a GPU. Set TORCH_SPEC="torch" (or a CUDA pin) on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
BENCH_ARGS ?=

.PHONY: install test quality style bench cost-curve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[testing,quality,benchmark]"

test: install
	RUN_SLOW=$${RUN_SLOW:-1} $(PY) -m pytest tests -v -p no:cacheprovider --durations=15

quality: install
	$(VENV)/bin/ruff check src tests utils
	$(VENV)/bin/ruff format --check src tests utils

style: install
	$(VENV)/bin/ruff check --fix src tests utils
	$(VENV)/bin/ruff format src tests utils

bench: install
	$(PY) utils/benchmark.py $(BENCH_ARGS)

cost-curve: install
	$(PY) utils/benchmark.py --cost-curve $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
