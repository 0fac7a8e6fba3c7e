# The two commands of the README. Each installs what it needs first (fast
# when the venv is current).
VENV ?= .venv
CONFIG ?= deploy/hourglass.toml
DEMO_CONFIG ?= deploy/demo.toml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast up down clean

setup:
	@VENV=$(VENV) bash deploy/setup.sh

demo: setup
	$(VENV)/bin/python -m pipeline.demo --config $(DEMO_CONFIG)

# Unit + integration + end-to-end tests against real services.
test: setup
	$(VENV)/bin/python -m pytest -q

# Without the SmolLM2 end-to-end tests.
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not e2e"

up: setup
	$(VENV)/bin/hourglass up --config $(CONFIG)

down:
	$(VENV)/bin/hourglass down --config $(CONFIG)

clean: down
	rm -rf .hourglass
