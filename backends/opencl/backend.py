"""The OpenCL backend: the numpy reference's ops, one for one, on arrays that live on the device.

Read it side by side with ``backends/numpy_backend.py``: the methods come in the same order and do
the same arithmetic; where numpy calls a vectorised expression this calls a kernel of ``ops.cl``,
and where numpy calls BLAS this calls the one GEMM of ``gemm.cl`` (``gemm.py``). The host sees data
only in ``asarray``, ``to_numpy`` and the scalar loss; ``self.rt`` (``cl_runtime.py``) holds the
device, its queue and buffers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl.array as cla

from backends.base import Backend, WireConversion, check_labels
from backends.opencl import conv, maxpool, norms
from backends.opencl.cl_runtime import ClRuntime
from backends.opencl.device import describe_device, select_device
from backends.opencl.gemm import ENV_AUTOTUNE, AView, CView, default_tune_file

F32 = np.float32
i32 = np.int32


class OpenCLBackend(Backend, WireConversion):
    """One OpenCL device (see ``backends.opencl.device.select_device`` for ``device``).

    ``autotune``: time the GEMM variants on first use of each large shape (default: on,
    unless $TINYCONV_OPENCL_AUTOTUNE=0); ``tune_file``: where the choices are kept;
    ``profile``: keep every kernel's device time for ``self.rt.kernel_times()`` (benchmarks).
    """

    name = "opencl"

    def __init__(
        self,
        device: str | None = None,
        autotune: bool | None = None,
        tune_file: str | Path | None = None,
        profile: bool = False,
        **_: Any,
    ) -> None:
        if autotune is None:
            autotune = os.environ.get(ENV_AUTOTUNE, "1") != "0"
        tune_path = Path(tune_file) if tune_file is not None else default_tune_file()
        self.rt = ClRuntime(select_device(device), autotune, tune_path, profile, lambda: self.progress())
        # narrow_wire / widen_wire convert bf16 wire words here (False: the host does), on every device:
        # where the reads and writes cross a bus, half the bytes cross it; and on PoCL's CPU device, whose
        # buffers are host memory, one kernel pass still beats numpy's dozen (benchmarks/bench_wire_convert.py:
        # conv2's 64x500x16x16 output narrowed in 3.3 ms instead of 100, widened in 3.4 instead of 6.9)
        self.wire_on_device = True

    @property
    def rows(self) -> bool:
        """Whether the rows kernels run: True on CPU devices; tests and benchmarks set it to run either."""
        return self.rt.rows

    @rows.setter
    def rows(self, value: bool) -> None:
        self.rt.rows = bool(value)

    # ---- edges ---------------------------------------------------------------------
    def asarray(self, x: np.ndarray) -> cla.Array:
        if isinstance(x, cla.Array) and x.context == self.rt.context:
            return x.copy()
        a = np.asarray(self.to_numpy(x))  # from the host, or from another device through it
        if a.dtype.kind not in "fiub":
            raise TypeError(f"asarray: cannot put a {a.dtype} array on an OpenCL device; use float32 or ints")
        a = np.ascontiguousarray(a, dtype=F32 if a.dtype.kind == "f" else None)
        return cla.to_device(self.rt.queue, a, allocator=self.rt.pool)

    def to_numpy(self, x: cla.Array) -> np.ndarray:
        return x.get() if isinstance(x, cla.Array) else np.asarray(x)

    def zeros(self, shape: tuple[int, ...]) -> cla.Array:
        return cla.zeros(self.rt.queue, tuple(shape), F32, allocator=self.rt.pool)

    def describe(self) -> dict[str, Any]:
        d = describe_device(self.rt.device)
        return {"backend": self.name, "device": d.pop("name"), **d}

    def synchronize(self) -> None:
        self.rt.queue.finish()

    # ---- wire words on the device (base.py's optional WireConversion, beside the host path; wire.cl) ---
    # bfloat16 only: 2 bytes a number instead of 4 across the device's link, bit for bit the host's
    # words. (fp16 and adt24 stay on the host: fp16's rounding of subnormals and adt24's 3-byte
    # words are not worth a kernel; s8 needs a reduction per plane first.)
    WIRE_FORMATS = frozenset({"bf16"})

    def narrow_wire(self, x, fmt):
        if fmt not in self.WIRE_FORMATS or not self.wire_on_device:
            return None
        x = self.rt.operand(x, "narrow_wire x")
        if x.size == 0:
            return None
        out = self.rt.empty(x.shape, np.uint16)
        overflow = cla.zeros(self.rt.queue, (1,), i32, allocator=self.rt.pool)
        self.rt.flat("narrow_bf16", x.size, x.data, i32(x.size), out.data, overflow.data)
        return out.get(), bool(overflow.get()[0])

    def widen_wire(self, carried, fmt):
        if fmt not in self.WIRE_FORMATS or not self.wire_on_device:
            return None
        c = np.ascontiguousarray(carried)
        if c.dtype != np.dtype("<u2"):
            raise TypeError(f"widen_wire: bf16 words travel as uint16, got {c.dtype}")
        if c.size == 0:
            return None
        words = cla.to_device(self.rt.queue, c, allocator=self.rt.pool)
        y = self.rt.empty(c.shape)
        self.rt.flat("widen_bf16", c.size, words.data, i32(c.size), y.data)
        return y

    # ---- convolution (im2col + GEMM, see conv.py) ------------------------------------
    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        return conv.forward(self.rt, x, w, b, stride, padding)

    def conv2d_backward(self, dy, cache, need_dx=True):
        return conv.backward(self.rt, dy, cache, need_dx)

    # ---- elementwise, and the normalisations (norms.py) ---------------------------
    def relu_forward(self, x):
        x = self.rt.operand(x, "relu x")
        y = self.rt.empty(x.shape)
        self.rt.flat("relu_forward", x.size, x.data, i32(x.size), y.data)
        return y, y

    def relu_backward(self, dy, cache):
        dy = self.rt.operand(dy, "relu dy")
        dx = self.rt.empty(dy.shape)
        self.rt.flat("relu_backward", dy.size, dy.data, cache.data, i32(dy.size), dx.data)
        return dx

    def lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        return norms.lrn_forward(self.rt, x, size, alpha, beta, k)

    def lrn_backward(self, dy, cache):
        return norms.lrn_backward(self.rt, dy, cache)

    # An optimisation beside relu_* and lrn_*, which stay: ReLU then LRN as one kernel each way (norms.py).
    def relu_lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        return norms.lrn_forward(self.rt, x, size, alpha, beta, k, relu=True)

    relu_lrn_backward = lrn_backward  # the cache says which kernel

    def batchnorm_forward(self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
        return norms.batchnorm_forward(self.rt, x, gamma, beta, running_mean, running_var, training, momentum, eps)

    def batchnorm_backward(self, dy, cache):
        return norms.batchnorm_backward(self.rt, dy, cache)

    # ---- pooling (maxpool.py) -----------------------------------------------------------
    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        return maxpool.forward(self.rt, x, kernel, stride, padding)

    def maxpool_backward(self, dy, cache):
        return maxpool.backward(self.rt, dy, cache)

    # ---- dense ---------------------------------------------------------------------------
    def linear_forward(self, x, w, b):
        x, w, b = self.rt.operand(x, "linear x"), self.rt.operand(w, "linear w"), self.rt.operand(b, "linear b")
        n, d = x.shape[0], int(np.prod(x.shape[1:]))
        if w.ndim != 2 or w.shape[1] != d:
            raise ValueError(f"linear: input {x.shape} flattens to {d}, weights expect {w.shape[1:]}")
        mo = w.shape[0]
        if b.shape != (mo,):
            raise ValueError(f"linear: bias {b.shape} does not match weights {w.shape}: expected ({mo},)")
        y = self.rt.empty((n, mo))
        # y^T (M, N) = w (M, D) @ x^T (D, N), so the bias is per row; C(m, s) -> y[s, m]
        a, c = AView(w.data, d, 1, d), CView(y.data, 1, mo, n)
        self.rt.gemm("linear_fwd", mo, n, d, a, lambda nb: self.rt.pack(x, d, n, 1, d, nb), c, bias=b)
        return y, (x, w)

    def linear_backward(self, dy, cache):
        x, w = cache
        dy = self.rt.operand(dy, "linear dy")
        n, (mo, d) = x.shape[0], w.shape
        if dy.shape != (n, mo):
            raise ValueError(f"linear_backward: dy {dy.shape} does not match the forward output {(n, mo)}")
        dx, dw = self.rt.empty(x.shape), self.rt.empty((mo, d))
        # dx (N, D) = dy (N, M) @ w (M, D)
        a, c = AView(dy.data, mo, 1, mo), CView.rows(dx.data, d)
        self.rt.gemm("linear_dx", n, d, mo, a, lambda nb: self.rt.pack(w, mo, d, d, 1, nb), c)
        # dw (M, D) = dy^T (M, N) @ x (N, D)
        a, c = AView(dy.data, 1, mo, n), CView.rows(dw.data, d)
        self.rt.gemm("linear_dw", mo, d, n, a, lambda nb: self.rt.pack(x, n, d, d, 1, nb), c)
        db = self.rt.reduce_rows(dy, mo, n, 1, (1, mo, 0))
        return dx, dw, db

    def softmax_cross_entropy(self, logits, labels):
        logits = self.rt.operand(logits, "softmax_cross_entropy logits")
        labels = self.to_numpy(labels)
        if logits.ndim != 2:
            raise ValueError(f"softmax_cross_entropy: logits must be (N, K), got {logits.shape}")
        n, k = logits.shape
        check_labels(labels, n, k)
        dev_labels = cla.to_device(self.rt.queue, labels.astype(np.int32), allocator=self.rt.pool)
        d, rows, loss = self.rt.empty((n, k)), self.rt.empty((n,)), self.rt.empty((1,))
        self.rt.launch("softmax_xent", n, logits.data, dev_labels.data, i32(n), i32(k), d.data, rows.data)
        self.rt.launch("mean_of", 1, rows.data, i32(n), loss.data)
        return float(loss.get()[0]), d

    # ---- optimiser -----------------------------------------------------------------------
    def sgd_update(self, param, grad, velocity, lr, momentum, weight_decay):
        param = self.rt.operand(param, "sgd_update param", in_place=True)
        velocity = self.rt.operand(velocity, "sgd_update velocity", in_place=True)
        grad = self.rt.operand(grad, "sgd_update grad")
        if not param.shape == grad.shape == velocity.shape:
            raise ValueError(f"sgd_update: param {param.shape}, grad {grad.shape} and velocity {velocity.shape} differ")
        state = (param.data, grad.data, velocity.data)
        self.rt.flat("sgd_update", param.size, *state, F32(lr), F32(momentum), F32(weight_decay), i32(param.size))

    # ---- small helpers used by the sharded convolution --------------------------------------
    def take_kernels(self, w, start, stop):
        """Rows [start, stop) of w, as a new contiguous array (kernels take whole buffers)."""
        w = self.rt.operand(w, "take_kernels w")
        if not 0 <= start < stop <= w.shape[0]:
            raise ValueError(f"take_kernels: rows [{start}, {stop}) are not a non-empty range of {w.shape[0]}")
        return w[start:stop].copy()
