"""Shared pytest fixtures, and the ``numerics`` marker. Keep this small: what more than one test file uses."""

from __future__ import annotations

import signal

import numpy as np
import pytest

# The files whose float comparisons sum in float32 through BLAS or OpenCL (backends.conformance.runner's
# float32_tolerance): `make test` runs them again under other OpenBLAS kernels (-m numerics).
NUMERICS = {
    "test_api.py",
    "test_block.py",
    "test_conformance.py",
    "test_distributed.py",
    "test_gradcheck.py",
    "test_opencl.py",
    "test_teaching_examples.py",
    "test_tolerance.py",
    "test_worker.py",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "numerics: float32 comparisons of BLAS and OpenCL sums; make test reruns them")
    # The tests of Ctrl-C need Python's SIGINT handler, here and in the workers they start; a run
    # started in the background by a shell (`make test &`, nohup) begins with SIGINT ignored.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NUMERICS:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, fixed-seed generator for each test, so every test is deterministic on its own."""
    return np.random.default_rng(1234)
