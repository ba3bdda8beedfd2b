# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-full lint bench stubs clean

$(STAMP): setup.cfg setup.py pyproject.toml $(wildcard hotpath/*.pyx hotpath/*.pxd hotpath/*.pxi)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sloserve.cli.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --timeout=900

test-full: $(STAMP)
	SLOSERVE_FULL=1 $(PY) -m pytest -q --timeout=7200

lint: $(STAMP)
	$(PY) -m ruff check .

stubs: $(STAMP)
	$(PY) -m sloserve.pb.generate

clean:
	rm -rf $(VENV) build *.egg-info hotpath/*.c hotpath/*.so
