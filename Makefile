# Two entry points for a fresh machine: `make demo` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# CPU torch first (an unpinned torch pulls GBs of CUDA packages), then remask with the extras its tests use.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,serve,eval,quant,plot,ray]"
	touch $@

demo: setup
	$(BIN)/python -m remask.demo $(DEMO_ARGS)

test: setup
	$(BIN)/python -m pytest -q tests

# Kernel microbenchmarks (Triton compiled on a GPU, torch paths on CPU); report in bench/results/.
bench: setup
	$(BIN)/python -m pytest bench -q -p no:cacheprovider --benchmark-json=bench/results/latest.json
	$(BIN)/python bench/report.py bench/results/latest.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
