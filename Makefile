# The two commands of the README. Each installs what it needs first (fast
# when the venv is current).
VENV ?= .venv
CONFIG ?= deploy/hourglass.toml
DEMO_CONFIG ?= deploy/demo.toml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

PY_SRC := connectors trainer pipeline tests bench docs/hooks

.PHONY: setup lint format demo test test-unit test-e2e test-all docs docs-serve up down clean

setup:
	@VENV=$(VENV) bash deploy/setup.sh

demo: setup
	$(VENV)/bin/python -m pipeline.demo --config $(DEMO_CONFIG)

# Habits, checked before the tests: ruff's pyflakes rules (undefined names, unused imports),
# the ruff formatter (no diff allowed), and mypy on the library and bench/ (config in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check --no-cache $(PY_SRC)
	$(VENV)/bin/ruff format --check --no-cache $(PY_SRC)
	$(VENV)/bin/mypy

# Rewrite the tree in the project's format (what `make lint` checks).
format: setup
	$(VENV)/bin/ruff format --no-cache $(PY_SRC)

# Lint, then unit + integration tests against real services (broker, MLflow, vLLM on a tiny model).
test: lint
	$(VENV)/bin/python -m pytest -q -m "not e2e"

# The fast tests: no service and no model weights. tests/conftest.py marks a test `integration` or
# `model` by the fixtures it uses; e2e tests stay out too. No lint first.
test-unit: setup
	$(VENV)/bin/python -m pytest -q -m "not integration and not model and not e2e"

# The end-to-end tests on SmolLM2-135M with every real service (slow on CPU).
test-e2e: setup
	$(VENV)/bin/python -m pytest -q -m e2e

# All of it, in the order CI (.ci/run) runs it: `make test`, `make docs`, then `make test-e2e`.
test-all: test
	$(MAKE) docs
	$(MAKE) test-e2e

# The docs site (mkdocs + Material) into site/, warnings as errors: a broken link, a page missing from
# the nav or a configuration page without its generated reference fails the build.
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The site on http://127.0.0.1:8000, rebuilt on every change.
docs-serve: setup
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

up: setup
	$(VENV)/bin/hourglass up --config $(CONFIG)

down:
	$(VENV)/bin/hourglass down --config $(CONFIG)

clean: down
	rm -rf .hourglass site
