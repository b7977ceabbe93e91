# Two commands do all the set-up on a fresh machine:
#   make demo   -- the main job (distributed training over ZeroMQ on the OpenCL backend)
#   make test   -- ruff (lint and format) and the whole test suite
# Each creates or refreshes .venv first (idempotent: reinstalls only when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: setup opencl-runtime oclgrind test demo bench course clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(MAKE) --no-print-directory opencl-runtime
	touch $(STAMP)

# PyPI's PoCL (3.0) compiles for the CPU its LLVM recognises; on a newer one (AMD Zen 5, say) it asks
# for CPU "generic" and no kernel builds. Where the probe cannot build a kernel, Debian's PoCL, which
# maps any x86 CPU onto one of its own builds, is installed beside it as root with apt-get; its
# platform comes first, so the OpenCL backend's default device is one that works.
OPENCL_PROBE := import pyopencl as cl; from backends.opencl.device import select_device; \
	d = select_device(); cl.Program(cl.Context([d]), "__kernel void k(__global float *a) { a[0] = 1; }").build()

opencl-runtime:
	@$(PY) -c '$(OPENCL_PROBE)' >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "PyPI's PoCL builds no kernel on this CPU: installing Debian's pocl-opencl-icd beside it"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q pocl-opencl-icd >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q pocl-opencl-icd >/dev/null 2>&1; } || \
			echo "note: apt-get could not install pocl-opencl-icd: the OpenCL backend has no working device"; \
		else \
			echo "note: PyPI's PoCL builds no kernel on this CPU (sudo apt-get install pocl-opencl-icd gives one that does)"; \
		fi; }

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

test: $(STAMP) opencl-runtime oclgrind
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
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

# The main job's plan line says its preset (--preset, default quick: >= 75 % in about 16 minutes), network,
# epochs and steps and the accuracy and time to expect; its last line, the test accuracy it reached.
demo: $(STAMP)
	$(PY) examples/cifar10_dist.py --transport zmq --backend opencl $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_train_step.py

# The course's student pack (docs/teaching.md): build/course-pack/ (the lessons with their solutions
# stubbed, as .py and paired .ipynb; the graders; grade.py, points per exercise), zipped beside it as
# build/course-pack.zip, and build/course-pack-autograder.zip for Gradescope. ARGS="--lessons 1,2": some only.
course: $(STAMP)
	$(PY) course/pack/make.py --out build/course-pack $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
