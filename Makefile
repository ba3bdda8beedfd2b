# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-full lint format bench stubs clean

$(STAMP): setup.cfg setup.py pyproject.toml $(wildcard hotpath/*.pyx hotpath/*.pxd hotpath/*.pxi hotpath/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sloserve.cli.demo

test: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports  # the import layers: [tool.importlinter] in pyproject.toml
	$(PY) -m pytest -q --timeout=900

test-full: $(STAMP)
	SLOSERVE_FULL=1 $(PY) -m pytest -q --timeout=7200

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

stubs: $(STAMP)
	$(PY) -m sloserve.pb.generate

clean:
	rm -rf $(VENV) build *.egg-info hotpath/*.c hotpath/*.so

# Opt-in: the extensions built with AddressSanitizer into build/asan/ (the in-place build is not
# touched), then tests/hotpath run against them, subprocesses included; needs gcc and the venv.
ASAN_LIB := build/asan/lib/sloserve/hotpath
ASAN_ENV := LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1 \
	PYTHONPATH=tests/hotpath/asan SLOSERVE_HOTPATH_EXT_DIR=$(ASAN_LIB)
.PHONY: test-asan
test-asan:
	SLOSERVE_ASAN=1 $(PY) setup.py -q build_ext --force --build-lib build/asan/lib --build-temp build/asan/temp
	$(ASAN_ENV) $(PY) -c "import sloserve.hotpath._queue as q, sloserve.hotpath as h; \
	assert h.USING_EXTENSIONS and '/build/asan/' in q.__file__, q.__file__; print('ASan build:', q.__file__)"
	$(ASAN_ENV) $(PY) -m pytest -q -p no:cacheprovider --timeout=1800 tests/hotpath
