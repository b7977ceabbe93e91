"""An example out-of-tree tinyconv backend: the numpy reference, multi-threaded.

It splits the convolution the way tinyconv splits it across machines -- *by
kernels* -- but across the threads of one process: each thread computes the
output feature maps of its own slice of the filters, as one GEMM on the shared
im2col columns. numpy releases the GIL inside a matrix product, so the slices
really run at the same time. The backward splits the same way (dW by kernels,
dX by rows of the columns), and ReLU is split over contiguous chunks.

Every other op is inherited from the reference unchanged. That is the usual way
to start a backend: subclass the reference, replace one op, run the conformance
suite, repeat. (A backend for another device subclasses ``backends.base.Backend``
instead and implements every op; see docs/writing-a-backend.md.)

Registered by its own pyproject.toml, not by tinyconv::

    [project.entry-points."tinyconv.backends"]
    threaded = "tinyconv_threaded:ThreadedBackend"

With a multi-threaded BLAS, set OPENBLAS_NUM_THREADS=1 (or MKL_NUM_THREADS=1) so
the threads here are the only parallelism and do not oversubscribe the cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from backends.numpy_backend import NumpyBackend, col2im, conv_output_size, im2col


class ThreadedBackend(NumpyBackend):
    """The numpy reference with conv GEMMs and ReLU split over ``threads`` threads."""

    name = "threaded"

    def __init__(self, threads: int | None = None, **_: Any) -> None:
        threads = threads if threads is not None else min(4, os.cpu_count() or 1)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tinyconv-threaded")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threads": self.threads}  # "backend" is self.name

    # ---- the one helper: run fn(s) for each of up to `threads` contiguous slices of range(n)
    def _split(self, n: int, fn: Callable[[slice], None]) -> None:
        bounds = np.linspace(0, n, min(self.threads, max(n, 1)) + 1).astype(int)
        slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        for future in [self._pool.submit(fn, s) for s in slices]:
            future.result()  # re-raises a thread's exception here

    # ---- convolution: the reference's im2col GEMMs, split by kernels ---------
    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        n = x.shape[0]
        f, c, kh, kw = w.shape
        if x.ndim != 4 or x.shape[1] != c:
            raise ValueError(f"conv2d: input {x.shape} does not match weights {w.shape} (N, C, H, W)")
        oh = conv_output_size(x.shape[2], kh, stride, padding)
        ow = conv_output_size(x.shape[3], kw, stride, padding)
        cols = im2col(x, kh, kw, stride, padding)  # (C*KH*KW, N*OH*OW), shared by all threads
        w2 = w.reshape(f, -1)
        y2 = np.empty((f, cols.shape[1]), dtype=np.result_type(x, w))

        def kernels(s: slice) -> None:  # this thread's feature maps: Y2[s] = W2[s] @ cols + b[s]
            np.matmul(w2[s], cols, out=y2[s])
            y2[s] += b[s, None]

        self._split(f, kernels)
        y = np.ascontiguousarray(y2.reshape(f, n, oh, ow).transpose(1, 0, 2, 3))
        return y, (x.shape, w, cols, stride, padding)

    def conv2d_backward(self, dy, cache, need_dx=True):
        x_shape, w, cols, stride, padding = cache
        f, c, kh, kw = w.shape
        dy2 = np.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(f, -1)  # (F, N*OH*OW)
        w2 = w.reshape(f, -1)
        dw2 = np.empty(w2.shape, dtype=dy2.dtype)

        def kernels(s: slice) -> None:  # dW2[s] = dY2[s] @ cols^T, each thread its own filters
            np.matmul(dy2[s], cols.T, out=dw2[s])

        self._split(f, kernels)
        db = dy2.sum(axis=1)
        dx = None
        if need_dx:
            dcols = np.empty(cols.shape, dtype=dy2.dtype)

            def rows(s: slice) -> None:  # dcols[s] = W2[:, s]^T @ dY2: rows are independent
                np.matmul(w2[:, s].T, dy2, out=dcols[s])

            self._split(dcols.shape[0], rows)
            dx = col2im(dcols, x_shape, kh, kw, stride, padding)
        return dx, dw2.reshape(w.shape), db

    # ---- ReLU: contiguous chunks of the flattened array -------------------------
    def relu_forward(self, x):
        xf = np.ascontiguousarray(x).reshape(-1)
        y = np.empty_like(xf)
        self._split(xf.size, lambda s: np.maximum(xf[s], 0, out=y[s]))
        y = y.reshape(x.shape)
        return y, y

    def relu_backward(self, dy, cache):
        dyf, yf = np.ascontiguousarray(dy).reshape(-1), cache.reshape(-1)
        dx = np.empty_like(dyf)
        self._split(dyf.size, lambda s: np.multiply(dyf[s], yf[s] > 0, out=dx[s]))
        return dx.reshape(dy.shape)
