# Task runner. `make demo` and `make test` are the README's two commands: each
# creates or reuses .venv and installs what it needs first (scripts/bootstrap).
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: bootstrap bootstrap-vllm bench-vllm demo test lint typecheck docs unit bench soak gpu-check clean

bootstrap:
	@scripts/bootstrap

# The venv tests/vllm starts real vLLM engines from (vLLM pins its own packages).
bootstrap-vllm:
	@scripts/bootstrap-vllm

demo: bootstrap
	$(BIN)/lmcache-platform demo

test: bootstrap lint typecheck docs unit

lint: bootstrap
	$(BIN)/ruff check .

typecheck: bootstrap
	$(BIN)/mypy

docs: bootstrap
	$(BIN)/sphinx-build -q -W --keep-going -b html docs docs/_build/html

unit: bootstrap bootstrap-vllm
	$(BIN)/pytest -n 2 $(PYTEST_ARGS)

bench: bootstrap
	$(BIN)/lmcache-platform bench --quick

# Time to first token with and without the vLLM connector's hit (real engines; ~10 min).
bench-vllm: bootstrap bootstrap-vllm
	.venv-vllm/bin/python tests/bench/vllm_ttft.py

soak: bootstrap
	scripts/soak

# No bootstrap here: it would install the CPU torch; gpu-check builds its own venv on a GPU host.
gpu-check:
	scripts/gpu-check

clean:
	rm -rf docs/_build build dist .mypy_cache .ruff_cache .pytest_cache
