# Developer entry points. Everything runs in .venv, created and filled by scripts/setup.sh.
PY := .venv/bin/python
PYTEST_FLAGS ?=

.PHONY: setup test demo lint bench

setup:
	bash scripts/setup.sh

# pytest exits 5 when it collects no tests, so an empty run fails the build too.
test: setup
	$(PY) -m pytest tests $(PYTEST_FLAGS)

# `make demo ONCE=1` stops the server after the workflow ran.
demo: setup
	$(PY) scripts/demo.py $(if $(ONCE),--once,)

lint: setup
	$(PY) -m ruff check .

# Issue #5 benchmark (not a test): `make bench QUICK=1` is the under-5-minute version.
bench: setup
	$(PY) bench/run.py $(if $(QUICK),--quick,)
