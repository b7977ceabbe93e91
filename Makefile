# Two commands do all the set-up on a fresh machine:
#   make demo   -- the main job (distributed training over ZeroMQ on the OpenCL backend)
#   make test   -- ruff and the whole test suite
# Each creates or refreshes .venv first (idempotent: reinstalls only when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/cifar10_dist.py --transport zmq --backend opencl $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_train_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
