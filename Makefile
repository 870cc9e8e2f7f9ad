# Two entry points for a fresh machine: `make demo` and `make test` (each sets up .venv first).
# `make test` installs exactly constraints.txt (what CI last passed with: the lower ends of
# pyproject.toml's ranges); `make test-latest` installs the newest versions the ranges allow into
# .venv-latest and runs the same suite, so upstream drift shows the day it lands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LATEST_VENV ?= .venv-latest
OLDEST_VENV ?= .venv-oldest
EXTRAS := dev,serve,eval,quant,plot,ray
# CPU torch first (an unpinned torch pulls GBs of CUDA packages); the machine's newest CPU build.
TORCH := torch==2.13.0
# Both cores: test files run whole on one worker each (module fixtures are built once per file), handed
# out longest first (tests/conftest.py: LONGEST_FILES, then by test count; xdist's reorder is off).
PYTEST := -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests

.PHONY: setup demo test test-all test-portable test-latest test-oldest lock bench compiled-report compiled-report-all gpu-day clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt $(TORCH)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

demo: setup
	$(BIN)/python -m remask.demo $(DEMO_ARGS)

# `slow`: the cases a faster test covers (the rest of each reference fixture: tests/conftest.py, SAMPLED_CASES)
test: setup
	$(BIN)/python $(PYTEST) -m "not slow"

# every test, the slow ones included
test-all: setup
	$(BIN)/python $(PYTEST)

# The reference-fixture tests (marked `reference`) as other CPUs compute them: ATen's AVX2 kernels
# (what an AVX2-only machine runs, seen from an AVX-512 one) and its scalar ones (`default`, a
# stand-in for CPUs without x86 SIMD, ARM's included). docs/reference-fixtures.md: the margin rule.
PORTABLE_CAPABILITIES ?= avx2 default
test-portable: setup
	@for cap in $(PORTABLE_CAPABILITIES); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(BIN)/python $(PYTEST) -m "reference or portable" || exit 1; \
	done

# The newest versions the ranges allow (torch stays the CPU build above), from a fresh environment;
# the versions it ran with are printed and kept in $(LATEST_VENV)/versions.txt.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/pip install --quiet $(TORCH)
	$(LATEST_VENV)/bin/pip install --quiet --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]"
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	grep -iE '^(torch|transformers|accelerate|lm.eval|fastapi)==' $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python $(PYTEST) -m "not slow"

# The lowest versions the ranges allow: every direct dependency at its lower bound (triton 3.7.1,
# the one torch 2.13's CUDA build pins), the rest of the locked set as is (tests/oldest_constraints.py).
test-oldest:
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --quiet --upgrade pip
	$(PYTHON) tests/oldest_constraints.py > $(OLDEST_VENV)/oldest.txt
	$(OLDEST_VENV)/bin/pip install --quiet -c $(OLDEST_VENV)/oldest.txt $(TORCH)
	$(OLDEST_VENV)/bin/pip install --quiet -c $(OLDEST_VENV)/oldest.txt -e ".[$(EXTRAS)]"
	$(OLDEST_VENV)/bin/pip freeze --exclude-editable > $(OLDEST_VENV)/versions.txt
	grep -iE '^(torch|triton|transformers|accelerate|lm.eval|fastapi)==' $(OLDEST_VENV)/versions.txt
	$(OLDEST_VENV)/bin/python $(PYTEST) -m "not slow"

# Rewrite constraints.txt from the passing $(LATEST_VENV) (run `make test-latest` first), then raise
# pyproject.toml's lower bounds to match (tests/test_packaging.py says which).
lock:
	test -f $(LATEST_VENV)/versions.txt
	{ sed -n '/^#/p' constraints.txt; sed -e 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/' $(LATEST_VENV)/versions.txt; } \
		> constraints.txt.new
	mv constraints.txt.new constraints.txt

# Kernel microbenchmarks (Triton compiled on a GPU, torch paths on CPU); report in bench/results/.
bench: setup
	$(BIN)/python -m pytest bench -q -p no:cacheprovider --benchmark-json=bench/results/latest.json
	$(BIN)/python bench/report.py bench/results/latest.json

# A lent GPU's first command (docs/benchmarks.md): every part time-boxed, <= 8 minutes on one H100 / H200;
# report in bench/results/gpu-<device>-<date>.md. GPU_DAY_ARGS=--dry-run runs every part's CPU form.
gpu-day: setup
	$(BIN)/python bench/gpu_day.py $(GPU_DAY_ARGS)

# The compiled-code gate (kernels/aot.py): every launched Triton kernel compiled for sm_80/90/100 on
# this CPU; recompiles what changed, rewrites kernels/aot_results.json and docs/compiled-kernels.md.
compiled-report: setup
	$(BIN)/python -m remask.kernels.aot --report docs/compiled-kernels.md

# The gate under every supported Triton (kernels/aot.py SUPPORTED_TRITON: what the CUDA builds of
# torch 2.13 / 2.14 / 2.15 pin), each in its own small venv under build/, then the report.
SUPPORTED_TRITON = 3.7.1 3.8.0 3.9.0
compiled-report-all: setup
	@for v in $(SUPPORTED_TRITON); do \
		venv=build/triton-$$v; \
		test -x $$venv/bin/python || { $(PYTHON) -m venv $$venv && $$venv/bin/pip install --quiet -c constraints.txt $(TORCH) numpy \
			&& $$venv/bin/pip install --quiet triton==$$v && $$venv/bin/pip install --quiet --no-deps -e .; } || exit 1; \
		echo "== Triton $$v"; $$venv/bin/python -m remask.kernels.aot --jobs 2 || exit 1; \
	done
	$(BIN)/python -m remask.kernels.aot --report docs/compiled-kernels.md

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(OLDEST_VENV) build *.egg-info .pytest_cache .benchmarks
