# `make demo` and `make test` each create (or reuse) .venv and install the project first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vlfit-installed
DEMO_DIR ?= runs/demo

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlfit demo --output_dir $(DEMO_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
