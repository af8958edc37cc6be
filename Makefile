# Two commands for a fresh machine with python3 (3.11+) and make:
#   make run    set up, then llmgw-server --local: Gemma 3 270M on llama.cpp, on :8080
#   make test   set up, then lint, type-check and run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Two cores: two trial workers.
JOBS ?= 2

.PHONY: run test lint typecheck unit e2e bench proto clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# compat mode keeps the project root on sys.path, where twistd finds
	# twisted/plugins/llmgw_plugins.py.
	$(BIN)/pip install --quiet -e '.[local,test,dev]' --config-settings editable_mode=compat
	touch $(STAMP)

run: $(STAMP)
	scripts/run-local

test: $(STAMP) lint typecheck
	$(BIN)/trial -j$(JOBS) tests

lint: $(STAMP)
	$(BIN)/ruff check llmgw tests bench twisted
	$(BIN)/ruff format --check llmgw tests bench twisted

typecheck: $(STAMP)
	$(BIN)/mypy llmgw

unit: $(STAMP)
	$(BIN)/trial -j$(JOBS) tests.test_sse tests.test_balancer tests.test_config tests.test_usage tests.test_sim tests.test_sim_site tests.test_sim_listening tests.test_wire tests.test_certs tests.test_placement tests.test_catalog tests.test_loop

e2e: $(STAMP)
	$(BIN)/trial -j$(JOBS) tests.test_e2e_router tests.test_e2e_llamacpp

# Regenerate llmgw/wire/agent_pb2.py(i) after editing proto/llmgw/v1/agent.proto
# (tests/test_wire.py fails while the checked-in code is stale).
proto: $(STAMP)
	scripts/gen-proto

bench: $(STAMP)
	$(BIN)/python bench/control_bench.py
	$(BIN)/python bench/router_bench.py

clean:
	rm -rf $(VENV) _trial_temp* *.egg-info
