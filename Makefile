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

# make test runs the numerics tests (-m numerics, tests/conftest.py) again on two other OpenBLAS
# kernel sets, AVX2 and SSE3, so that no float comparison holds only on this machine's. A probe asks
# OpenBLAS which kernels it runs (numpy's OpenBLAS names Prescott's Katmai) and skips a set this CPU
# cannot run (Haswell's on an x86 without AVX2) or that OpenBLAS does not know (another architecture).
NUMERICS_CORES := Haswell Prescott
PROBE := import numpy; a = numpy.ones((8, 8), "f"); a @ a

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	@for core in $(NUMERICS_CORES); do \
		said=$$(OPENBLAS_CORETYPE=$$core OPENBLAS_VERBOSE=2 $(PY) -c '$(PROBE)' 2>&1); \
		case "$$?: $$said" in \
		0:*"not found"*) echo "skipped OPENBLAS_CORETYPE=$$core: $$said";; \
		0:*"Core: "*) echo "OPENBLAS_CORETYPE=$$core $(PY) -m pytest -q -m numerics  # OpenBLAS: $$said"; \
			OPENBLAS_CORETYPE=$$core $(PY) -m pytest -q -m numerics || exit 1;; \
		*) echo "skipped OPENBLAS_CORETYPE=$$core: OpenBLAS's $$core kernels do not run here ($$said)";; \
		esac; \
	done

demo: $(STAMP)
	$(PY) examples/cifar10_dist.py --transport zmq --backend opencl $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_train_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
