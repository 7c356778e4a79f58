# The two commands of the quick start: `make demo` and `make test`. Each creates .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The image the manifests run by default; podman where it is installed, else docker.
IMAGE ?= localhost/gpuppetti:dev
CONTAINER_TOOL ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)

.PHONY: demo test unit e2e lint typecheck proto deploy image bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuppetti demo
	@echo "(gpuppetti is installed in $(BIN): '. $(BIN)/activate' puts the gpuppetti command on your PATH)"

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

image:
	$(CONTAINER_TOOL) build -t $(IMAGE) .

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info

bench: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/run.py --json bench/results.json
