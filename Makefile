# Two entry points for a fresh machine: `make demo` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# CPU torch first (an unpinned torch pulls GBs of CUDA packages), then remask with its dev extras.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/python -m remask.demo $(DEMO_ARGS)

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
