"""Grades lesson 4: the student's OpenCL kernels on their own, then their backend on the conformance suite."""

from __future__ import annotations

import numpy as np
import pytest

from backends.conformance import CASES
from backends.conformance.runner import run_case

LESSON = "04_opencl_backend"

cl = pytest.importorskip("pyopencl")


@pytest.fixture(scope="module")
def device():
    from backends.opencl.device import NoOpenCLDevice, select_device

    try:
        return select_device()
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device here: {e}")


def test_the_kernels_compute_relu_and_its_gradient(lesson, device):
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    program = cl.Program(ctx, lesson.relu_kernels()).build()
    rng = np.random.default_rng(0)
    n = 1000  # not a multiple of any work-group size
    x, dy = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    x[:3] = [0.0, -0.0, np.nan]
    mf = cl.mem_flags
    xb, dyb = (cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for a in (x, dy))
    yb, dxb = (cl.Buffer(ctx, mf.WRITE_ONLY, x.nbytes) for _ in range(2))
    program.relu_forward(queue, (n,), None, xb, yb, np.int32(n))
    program.relu_backward(queue, (n,), None, dyb, xb, dxb, np.int32(n))
    y, dx = np.empty_like(x), np.empty_like(x)
    cl.enqueue_copy(queue, y, yb)
    cl.enqueue_copy(queue, dx, dxb)
    np.testing.assert_array_equal(y[3:], np.maximum(x[3:], 0))
    assert np.isnan(y[2]), "relu_forward must keep a NaN (torch's ReLU does)"
    np.testing.assert_array_equal(dx, dy * (x > 0))


@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("relu", "relu_lrn")], ids=lambda c: c.id)
def test_the_backend_passes_the_relu_conformance_cases(lesson, device, case):
    backend = lesson.ClReluBackend(device)
    failed = [r for r in run_case(backend, case) if not r.passed]
    assert not failed, "; ".join(f"{r.output}: {r.note}" for r in failed)


def test_the_backend_runs_its_own_relu(lesson):
    from backends.numpy_backend import NumpyBackend

    assert lesson.ClReluBackend.relu_forward is not NumpyBackend.relu_forward, "relu_forward must be replaced"
    assert lesson.ClReluBackend.relu_backward is not NumpyBackend.relu_backward, "relu_backward must be replaced"
