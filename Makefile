# `make demo` and `make test` each create (or reuse) .venv and install the project first, with the exact versions
# of requirements/ci.txt (the same set CI installs).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vlfit-installed
LOCK := requirements/ci.txt
DEMO_DIR ?= runs/demo
DEMO_QUICK_DIR ?= runs/demo-quick

.PHONY: install demo demo-quick test test-fast lint docs lock clean

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e ".[all,test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlfit demo --output_dir $(DEMO_DIR)

# The same run at a size that takes about a minute on 2 cores: a first look.
demo-quick: $(STAMP)
	$(VENV)/bin/vlfit demo --quick --output_dir $(DEMO_QUICK_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports  # no import points up the layers of [tool.importlinter] in pyproject.toml

# Two pytest workers, a test file each at a time (each worker runs torch on one thread: tests/conftest.py).
PYTEST_WORKERS ?= -n 2 --dist loadfile

# scripts/system-packages.sh first: Debian's chromium for the browser test and nginx for the front's test, installed
# where apt-get and root or sudo allow; elsewhere one line says those tests are skipped.
test: lint
	@scripts/system-packages.sh
	$(PY) -m pytest $(PYTEST_WORKERS)

# The edit-test loop (under 2 minutes on 2 cores): every test but those marked slow (whole commands, training runs,
# subprocesses, torchrun, the server process, exports). `make test` runs them all, as CI does.
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_WORKERS) -m "not slow"

# docs/cli.md from every command's --help, and the flag index vlfit answers --help and typos from before its
# heavy imports (tests/test_docs.py and tests/test_flag_index.py fail when either is stale).
docs: $(STAMP)
	$(PY) -m vlfit.commands.cli_reference > docs/cli.md
	$(PY) -m vlfit.commands.cli_reference --flag-index

# Re-pin requirements/ci.txt: a fresh venv with the newest releases pyproject.toml allows, frozen.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q ".[all,test]"
	head -3 $(LOCK) > $(LOCK).new
	.lock-venv/bin/python -m pip freeze --exclude-editable | grep -v '^vlfit' >> $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .lock-venv

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
