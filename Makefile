# pacmpi: `make demo` runs the main job, `make test` the test suite; both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
RANKS ?= 4

.PHONY: setup demo test doctor wheel bench-allreduce bench-train clean

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh $(RANKS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

doctor: setup
	$(VENV)/bin/pacmpi doctor --ranks $(RANKS)

# Offline: builds with the venv's setuptools instead of fetching a fresh one.
wheel: setup
	$(PY) -m build --no-isolation --outdir dist

bench-allreduce: setup
	$(VENV)/bin/pacmpi-run -n $(RANKS) --oversubscribe -- $(PY) -m pacmpi.cli bench allreduce --sizes 64M --densities 1.0,0.5,0.2 --iters 5 --warmup 2 --json results/bench_allreduce_$(RANKS)r.json

bench-train: setup
	$(VENV)/bin/pacmpi bench train --out-dir results

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
