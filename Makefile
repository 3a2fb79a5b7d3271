# The two commands a new user runs: `make demo` and `make test`. Both set up .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "mlx-scheduler needs Python 3.11+; set PYTHON=python3.11 (or newer)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,cluster,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mlx-scheduler demo

test: $(STAMP) lint docs
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks $(wildcard examples)
	$(VENV)/bin/mypy

# The handbook, built with --strict so a broken link or a page missing from the nav fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info
