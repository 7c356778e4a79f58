# The two commands of the quick start: `make demo` and `make test`. Each creates .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit e2e lint typecheck proto deploy bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuppetti demo

test: lint typecheck
	$(BIN)/python -m pytest

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

e2e: $(STAMP)
	$(BIN)/python -m pytest tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check src tests tools bench
	$(BIN)/lint-imports --no-logo --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

deploy: $(STAMP)
	$(BIN)/python tools/gen_deploy.py

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info

bench: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/run.py --json bench/results.json
