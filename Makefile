# The two commands of the README. Each installs what it needs first (fast
# when the venv is current).
VENV ?= .venv
CONFIG ?= deploy/hourglass.toml
DEMO_CONFIG ?= deploy/demo.toml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup lint demo test test-e2e test-all up down clean

setup:
	@VENV=$(VENV) bash deploy/setup.sh

demo: setup
	$(VENV)/bin/python -m pipeline.demo --config $(DEMO_CONFIG)

# Lint (pyflakes: undefined names, unused imports), then unit + integration tests against real
# services (broker, MLflow, vLLM on a tiny model).
lint: setup
	$(VENV)/bin/ruff check --no-cache connectors trainer pipeline tests bench

test: lint
	$(VENV)/bin/python -m pytest -q -m "not e2e"

# The SmolLM2 end-to-end rounds (slow on CPU: about 25 min on 2 cores).
test-e2e: setup
	$(VENV)/bin/python -m pytest -q -m e2e

test-all: setup
	$(VENV)/bin/python -m pytest -q

up: setup
	$(VENV)/bin/hourglass up --config $(CONFIG)

down:
	$(VENV)/bin/hourglass down --config $(CONFIG)

clean: down
	rm -rf .hourglass
