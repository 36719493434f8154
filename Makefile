PYTHON ?= python3

.PHONY: install test test-gpu validate compile bench lint

install:            ## the one set-up command
	$(PYTHON) -m pip install -e '.[dev]'

test:               ## spec check + CPU + compile-only tests (GPU tests skip without CUDA)
	tileops validate
	$(PYTHON) -m pytest -q tests; rc=$$?; [ $$rc -eq 5 ] && exit 0 || exit $$rc

test-gpu:           ## the GPU tests only
	$(PYTHON) -m pytest -q -m gpu tests

validate:
	tileops validate

compile:
	tileops compile

bench:              ## needs a GPU; reports in bench-results/
	tileops bench --out bench-results

lint:
	ruff check src tests benchmarks scripts
