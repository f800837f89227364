# Quick start: `make demo` (run the main scenario), `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gpucloud demo

test: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 4 --dist worksteal

# What CI checks before the tests: lint, format and types.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

clean:
	rm -rf $(VENV) .data
