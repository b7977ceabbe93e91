# Two commands do all the set-up on a fresh machine:
#   make demo   -- the main job (distributed training over ZeroMQ on the OpenCL backend)
#   make test   -- ruff and the whole test suite
# Each creates or refreshes .venv first (idempotent: reinstalls only when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: setup oclgrind test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Oclgrind, Debian's OpenCL device simulator, runs the OpenCL tests on a simulated GPU that checks
# every memory access and every race (tests/test_oclgrind.py, skipped without it). make test
# installs it where it can: as root with apt-get; elsewhere it says how.
oclgrind:
	@command -v oclgrind >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's oclgrind, the OpenCL simulator tests/test_oclgrind.py runs on"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q oclgrind >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q oclgrind >/dev/null 2>&1; } || \
			echo "note: apt-get could not install oclgrind: tests/test_oclgrind.py is skipped"; \
		else \
			echo "note: oclgrind is not installed (sudo apt-get install oclgrind): tests/test_oclgrind.py is skipped"; \
		fi; }

# make test runs the numerics tests (-m numerics, tests/conftest.py) again on two other OpenBLAS
# kernel sets, AVX2 and SSE3, so that no float comparison holds only on this machine's. A probe asks
# OpenBLAS which kernels it runs (numpy's OpenBLAS names Prescott's Katmai) and skips a set this CPU
# cannot run (Haswell's on an x86 without AVX2) or that OpenBLAS does not know (another architecture).
NUMERICS_CORES := Haswell Prescott
PROBE := import numpy; a = numpy.ones((8, 8), "f"); a @ a

test: $(STAMP) oclgrind
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

# The main job's first line after loading the data says its preset (--preset, default best), network,
# epochs and steps and the accuracy and time to expect; its last line, the test accuracy it reached.
demo: $(STAMP)
	$(PY) examples/cifar10_dist.py --transport zmq --backend opencl $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_train_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
