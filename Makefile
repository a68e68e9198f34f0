# transformers-lookahead: `make bench` runs a quick benchmark on the real model, `make test` the test suite.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel is kept when torch is already installed; otherwise installing it first stops pip from pulling a
# multi-GB CUDA build on a machine without a GPU. Set TORCH_SPEC="torch" (or a CUDA pin) on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
BENCH_ARGS ?=
# The oldest Transformers the package allows (`compatibility.TRANSFORMERS_REQUIREMENT`): `make test-oldest` runs the
# suite against it.
TRANSFORMERS_OLDEST := $(shell sed -n '/^TRANSFORMERS_REQUIREMENT/s/[^0-9.]*\([0-9.]*\).*/\1/p' src/transformers_lookahead/compatibility.py)
OLDEST_VENV ?= .venv-oldest

.PHONY: install test test-oldest quality style bench bench-full bench-memory cost-curve gpu-check serve hub-repo clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[testing,quality,benchmark]"

# Two workers share the cores: each takes a test class at a time (its shared setup once) and its share of the threads
# (tests/conftest.py).
TEST_WORKERS ?= 2
WORKER_ARGS := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
test: install
	RUN_SLOW=$${RUN_SLOW:-1} $(PY) -m pytest tests -v -p no:cacheprovider --durations=15 $(WORKER_ARGS)

# The suite (without the slow real-model tests) against the oldest Transformers allowed, in its own venv; skipped
# while that is the version `make test` already ran against.
test-oldest: install
	@if $(PY) -c "import sys, transformers; sys.exit(transformers.__version__.startswith('$(TRANSFORMERS_OLDEST).'))"; then \
		$(MAKE) install VENV=$(OLDEST_VENV) && \
		$(OLDEST_VENV)/bin/python -m pip install --quiet "transformers==$(TRANSFORMERS_OLDEST).*" && \
		RUN_SLOW=0 $(OLDEST_VENV)/bin/python -m pytest tests -q -p no:cacheprovider $(WORKER_ARGS); \
	else \
		echo "test-oldest: the oldest Transformers allowed ($(TRANSFORMERS_OLDEST)) is the one make test ran against."; \
	fi

quality: install
	$(VENV)/bin/ruff check src tests utils
	$(VENV)/bin/ruff format --check src tests utils

style: install
	$(VENV)/bin/ruff check --fix src tests utils
	$(VENV)/bin/ruff format src tests utils

# About 10 minutes on 2 cores: greedy / prompt lookup / "auto" on 5 + 5 prompts, its result in bench_out/; in
# bfloat16 where this machine computes it natively (else float32, and it says so), with float32 greedy beside it.
bench: install
	$(PY) -m utils.bench generate $(BENCH_ARGS)

# Both models in both dtypes: 16 + 16 prompts, every method, 3 repeats; one folder per run under
# bench_out/ (about an hour per run on 2 cores for SmolLM2, three for Qwen2.5-Coder-0.5B).
BENCH_MODELS ?= smollm2 qwen-coder
BENCH_DTYPES ?= bfloat16 float32
bench-full: install
	@for model in $(BENCH_MODELS); do for dtype in $(BENCH_DTYPES); do \
		$(PY) -m utils.bench generate --full --model $$model --dtype $$dtype --output-dir bench_out/$$model-$$dtype \
			$(BENCH_ARGS) || exit 1; \
	done; done

# The suffix memory across calls: four workloads that repeat themselves, greedy / prompt lookup / "auto" without and
# with memory (about 30 minutes on 2 cores with BENCH_ARGS="--num-prompts 6").
bench-memory: install
	$(PY) -m utils.bench memory $(BENCH_ARGS)

cost-curve: install
	$(PY) -m utils.bench cost-curve $(BENCH_ARGS)

# Accelerator checks on tiny random models (no network); DEVICE=cpu runs them on the CPU.
gpu-check: install
	$(PY) -m utils.bench gpu-check $(GPU_CHECK_ARGS)

# SmolLM2-135M-Instruct behind `transformers serve` on 127.0.0.1:8000, decoding with lookahead ("auto").
serve: install
	$(PY) -m utils.bench serve $(SERVE_ARGS)

# The strategy as a Hub repository stock Transformers runs (`custom_generate=<repo>`): README + self-contained
# custom_generate/, written to HUB_DIR (upload it as it is).
HUB_DIR ?= hub_repo
hub-repo: install
	$(PY) -m utils.bench hub-repo $(HUB_DIR) $(HUB_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache hub_repo
