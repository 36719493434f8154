PYTHON ?= python3
# What `make test` runs: CPU tests, GPU tests when a CUDA device is visible, and the compile
# smoke set (one program per kernel path). `full` and `nightly` tests are their own targets.
FAST = -m "not full and not nightly" --durations=15

.PHONY: install test test-full test-gpu validate compile compile-full bench lint

install:            ## the one set-up command
	$(PYTHON) -m pip install -e '.[dev]'

test:               ## spec check + CPU + GPU (when present) + compile smoke set
	tileops validate
	$(PYTHON) -m pytest -q $(FAST) tests; rc=$$?; [ $$rc -eq 5 ] && exit 0 || exit $$rc

test-full:          ## every test, the compile checks of every config variant included
	tileops validate
	$(PYTHON) -m pytest -q --durations=25 tests; rc=$$?; [ $$rc -eq 5 ] && exit 0 || exit $$rc

test-gpu:           ## the GPU tests only
	$(PYTHON) -m pytest -q -m gpu tests

validate:
	tileops validate

compile:            ## compile sweep of the smoke workloads for sm_90a (nvcc, no GPU)
	tileops compile --tier smoke

compile-full:       ## compile sweep of every manifest workload
	tileops compile --tier full

bench:              ## needs a GPU; reports in bench-results/
	tileops bench --out bench-results

lint:
	ruff check src tests benchmarks scripts
