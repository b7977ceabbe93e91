# %% [markdown]
# # Lesson 4 — A backend: one op ported to OpenCL, proved by the conformance suite
#
# **Time:** about 35 minutes. **Needs:** one machine with an OpenCL device. `make setup`
# installs PoCL, a CPU OpenCL runtime, so any machine has one; a GPU needs only its driver
# (`tinyconv devices` lists what it sees).
#
# A tinyconv *backend* is what the layers compute on: a short list of ops, each a forward/backward
# pair (`backends/base.py`, `docs/writing-a-backend.md`). The usual way to start one is the way
# `examples/threaded_backend/` does: **subclass the numpy reference, replace one op, run the
# conformance suite, repeat.** Here the op is the ReLU, and the device is OpenCL.

# %% tags=["setup"]
import time

import numpy as np
import pyopencl as cl
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

from backends.conformance import CASES  # noqa: E402
from backends.conformance.runner import format_table, run_case  # noqa: E402
from backends.numpy_backend import NumpyBackend
from backends.opencl.device import select_device
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402

# %% [markdown]
# ## 1. The contract, and the suite that holds a backend to it
#
# `y, cache = backend.relu_forward(x)` and `dx = backend.relu_backward(dy, cache)`: NCHW float32 in,
# float32 out of the same shape, inputs never modified. The conformance suite
# (`backends/conformance/`) runs every op of a backend on awkward shapes and values against the
# numpy reference and compares outputs with float32 tolerances; from the shell it is
# `tinyconv conformance --backend NAME`, in Python `run_conformance(backend)`. Here are the cases
# for the two ops this lesson touches (the fused `relu_lrn` calls the ReLU too):

# %%
mine = [case for case in CASES if case.op in ("relu", "relu_lrn")]
print(f"{len(CASES)} cases in all; {len(mine)} exercise the ReLU:")
for case in mine:
    print(f"  {case.op:9s} {case.label}")

# %% [markdown]
# ## 2. OpenCL in five objects
#
# A **device** (a GPU, or PoCL's CPU device); a **context** and a **command queue** on it; **buffers**
# in the device's memory; a **program** of kernels in OpenCL C, compiled at run time for that device;
# a **launch** of a kernel over a global size, one work-item per element. A first kernel, `scale`:

# %%
device = select_device()  # $TINYCONV_OPENCL_DEVICE, else the first GPU, else the first device
ctx = cl.Context([device])
queue = cl.CommandQueue(ctx)
print("device:", device.name.strip(), "|", device.platform.name.strip())

program = cl.Program(
    ctx,
    """
__kernel void scale(__global const float *x, __global float *y, const float a, const int n) {
    int i = get_global_id(0);          /* one work-item per element */
    if (i < n) y[i] = a * x[i];        /* the guard: the global size may be rounded up */
}
""",
).build()
x = np.arange(8, dtype=np.float32)
mf = cl.mem_flags
x_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)  # host -> device
y_buf = cl.Buffer(ctx, mf.WRITE_ONLY, x.nbytes)
program.scale(queue, (x.size,), None, x_buf, y_buf, np.float32(3), np.int32(x.size))
y = np.empty_like(x)
cl.enqueue_copy(queue, y, y_buf)  # device -> host; waits for the kernel
print("scale by 3:", y)

# %% [markdown]
# ## Exercises
#
# 1. `relu_kernels()`: the OpenCL C source of two kernels,
#    `relu_forward(__global const float *x, __global float *y, const int n)` ($y = \max(x, 0)$) and
#    `relu_backward(__global const float *dy, __global const float *x, __global float *dx, const int n)`
#    ($dx = dy \cdot [x > 0]$). Mind the guard, and NaN, which the reference propagates: `fmax(x, 0)`
#    returns 0 for a NaN where torch's ReLU keeps it (`x != x` is true only for a NaN), and
#    `dy * [x > 0]` is NaN for a NaN `dy` (the fused ReLU + LRN case sends one).
# 2. `ClReluBackend`: the numpy reference with those two ops replaced: copy the input to the
#    device, launch, copy back. Keep what the backward needs in the cache.
#
# Then run the suite's ReLU cases on it (the cell after), and the whole suite. Grade:
# `pytest course/ --student-dir YOUR_FOLDER -k lesson4`.


# %% tags=["exercise"]
def relu_kernels() -> str:
    """OpenCL C source with the kernels relu_forward(x, y, n) and relu_backward(dy, x, dx, n)."""
    # BEGIN SOLUTION
    # TODO: two __kernel functions, one work-item per element, each guarded by `if (i < n)`
    return """
    __kernel void relu_forward(__global const float *x, __global float *y, const int n) {
        int i = get_global_id(0);
        if (i < n) { float v = x[i]; y[i] = (v > 0.0f || v != v) ? v : 0.0f; }  /* NaN stays NaN */
    }
    __kernel void relu_backward(__global const float *dy, __global const float *x, __global float *dx,
                                const int n) {
        int i = get_global_id(0);
        if (i < n) dx[i] = dy[i] * (x[i] > 0.0f ? 1.0f : 0.0f);  /* as dy * (x > 0): a NaN in dy stays NaN */
    }
    """
    # END SOLUTION


class ClReluBackend(NumpyBackend):
    """The numpy reference, with relu_forward and relu_backward run as OpenCL kernels."""

    name = "cl-relu"

    def __init__(self, device: "cl.Device | None" = None) -> None:
        self.ctx = cl.Context([device or select_device()])
        self.queue = cl.CommandQueue(self.ctx)
        self.program = cl.Program(self.ctx, relu_kernels()).build()
        # each retrieval of a kernel from the program makes a new one: take them once
        self.kernels = {name: cl.Kernel(self.program, name) for name in ("relu_forward", "relu_backward")}

    def _run(self, kernel: str, out_like: np.ndarray, *inputs: np.ndarray) -> np.ndarray:
        """Copy ``inputs`` (float32, C order) to the device, run ``kernel`` on every element, copy the result back."""
        # BEGIN SOLUTION
        # TODO: as part 2's scale demo: inputs to device buffers, one for the output, a work-item per element, copy back
        mf = cl.mem_flags
        bufs = [cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for a in inputs]
        out = np.empty_like(out_like)
        out_buf = cl.Buffer(self.ctx, mf.WRITE_ONLY, max(out.nbytes, 4))  # a buffer may not be 0 bytes
        if out.size:
            self.kernels[kernel](self.queue, (out.size,), None, *bufs, out_buf, np.int32(out.size))
            cl.enqueue_copy(self.queue, out, out_buf)
        return out
        # END SOLUTION

    def relu_forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # BEGIN SOLUTION
        # TODO: the kernels read contiguous float32; run the forward kernel; keep what the backward will need
        x = np.ascontiguousarray(x, dtype=np.float32)
        return self._run("relu_forward", x, x), x
        # END SOLUTION

    def relu_backward(self, dy: np.ndarray, cache: np.ndarray) -> np.ndarray:
        # BEGIN SOLUTION
        # TODO: contiguous float32 again; the backward kernel takes the gradient and what the forward kept
        dy = np.ascontiguousarray(dy, dtype=np.float32)
        return self._run("relu_backward", dy, dy, cache)
        # END SOLUTION


# %% [markdown]
# ### Run the suite on it
#
# First the ReLU's cases, then (in the full version) every case: the ops you did not touch are the
# reference's own, so they pass, and a failure is yours.

# %%
backend = ClReluBackend(device)
results = [r for case in mine for r in run_case(backend, case)]
print(format_table(results))
print(f"{sum(r.passed for r in results)}/{len(results)} ReLU checks pass")
if not QUICK:
    from backends.conformance.runner import run_conformance

    every = run_conformance(backend)
    print(f"the whole suite: {sum(r.passed for r in every)}/{len(every)} checks pass")

# %% [markdown]
# ### Is it faster?
#
# Time the numpy ReLU against yours, copies included. On a CPU device the copies cost as much as
# the work; that is why tinyconv's OpenCL backend keeps every array on the device from one op to the
# next (`backends/opencl/backend.py`: its `asarray` copies once, its ops take and return device
# arrays) and only the loss comes back each step.

# %%
ref = NumpyBackend()
sizes = [2**k for k in (range(10, 17, 3) if QUICK else range(10, 23, 2))]
timings: dict[str, list[tuple[float, float]]] = {"numpy": [], "OpenCL, copies included": []}
for n in sizes:
    xs = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    for name, be in (("numpy", ref), ("OpenCL, copies included", backend)):
        be.relu_forward(xs)  # warm-up: the first launch pays for setting up
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            be.relu_forward(xs)
            runs.append(time.perf_counter() - t0)
        timings[name].append((n, min(runs) * 1e6))  # the best of 3: the least disturbed
series = [Series(name, pts, c) for (name, pts), c in zip(timings.items(), colors(2), strict=True)]
show(
    line_chart(
        "ReLU forward, best of 3", [Panel(series, "elements", "microseconds", xlog=True, ylog=True, yfrom0=False)]
    ),
    "lesson4_relu_timing.svg",
)
