"""The numpy reference backend: every op vectorised, convolution as im2col + one GEMM.

Ops compute in their inputs' dtype (float32 in training; float64 arrays passed
straight to the ops stay float64, which is how tinyconv/gradcheck.py checks them).
No Python loop runs over the batch, pixels or channels, only over a window's offsets.

Convolution keeps its columns in the layout (C*KH*KW, N*OH*OW), so forward, dW
and dX are each *one* large GEMM, which is where BLAS is fastest:

    forward  Y2  = W2 @ cols                     (F, K) @ (K, NP) -> (F, NP)
    dW       dW2 = dY2 @ cols^T                  (F, NP) @ (NP, K) -> (F, K)
    dX       dcols = W2^T @ dY2, then col2im     (K, F) @ (F, NP) -> (K, NP)

with K = C*KH*KW and NP = N*OH*OW. Only Y and dY are transposed between
(N, F, ...) and (F, N, ...). The columns (im2col, col2im) are in numpy_columns.py,
the max pool in numpy_maxpool.py; the ops below call them.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

from backends import numpy_maxpool
from backends.base import Backend, check_labels, conv_output_size, require_batch_statistics
from backends.numpy_columns import col2im, im2col, transposed

F32 = np.float32


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _channel_window_sum(a: np.ndarray, before: int, after: int, out: np.ndarray | None = None) -> np.ndarray:
    """out[:, c] = sum of a[:, c-before .. c+after] along axis 1, clipped at the edges."""
    out = np.empty_like(a) if out is None else out
    np.copyto(out, a)
    c = a.shape[1]
    for d in range(1, min(before, c - 1) + 1):
        out[:, d:] += a[:, : c - d]
    for d in range(1, min(after, c - 1) + 1):
        out[:, : c - d] += a[:, d:]
    return out


def _channel_sum(a: np.ndarray) -> np.ndarray:
    """Per-channel sum of an (N, C, H, W) float32 map: (C,) float32.

    Summed as rows: each of the N*C contiguous rows of H*W values pairwise (numpy's add.reduce
    along the last axis: up to 128 values by 8 interleaved running sums, longer rows split in
    halves), then the N row sums of each channel one after the other. A value passes through at
    most d = N + ceil(log2(H*W)) + 16 roundings, so |error| <= d * 2^-24 * sum |a| (to first
    order; tests/test_batchnorm_numpy.py checks it against float64). ``a.sum(axis=(0, 2, 3))`` sums
    in this order too, but that is numpy's internals; this states it.
    """
    n, c = a.shape[:2]
    return a.reshape(n, c, -1).sum(axis=2).sum(axis=0)


def batchnorm_forward_plain(x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
    """Batch norm's forward written out (NumpyBackend.batchnorm_forward is the optimised twin):
    the same contract, a fresh array per step of the math, the cache (xhat, gamma, invstd, training)."""
    if training:
        require_batch_statistics(x.shape)
        m = x.shape[0] * x.shape[2] * x.shape[3]
        mean = x.mean(axis=(0, 2, 3))
        xc = x - mean[None, :, None, None]
        var = (xc * xc).mean(axis=(0, 2, 3))
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += (momentum * m / max(m - 1, 1)) * var
    else:
        mean, var = running_mean, running_var
        xc = x - mean[None, :, None, None]
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * invstd[None, :, None, None]
    y = xhat * gamma[None, :, None, None] + beta[None, :, None, None]
    return y, (xhat, gamma, invstd, training)


def batchnorm_backward_plain(dy, cache):
    """Batch norm's backward written out, for batchnorm_forward_plain's cache (see BatchNorm2D's math)."""
    xhat, gamma, invstd, training = cache
    dbeta = dy.sum(axis=(0, 2, 3))
    dgamma = (dy * xhat).sum(axis=(0, 2, 3))
    g = (gamma * invstd)[None, :, None, None]
    if not training:  # statistics are constants in eval mode
        return dy * g, dgamma, dbeta
    m = dy.shape[0] * dy.shape[2] * dy.shape[3]
    dx = g * (dy - (dbeta / m)[None, :, None, None] - xhat * (dgamma / m)[None, :, None, None])
    return dx, dgamma, dbeta


def sgd_update_plain(param, grad, velocity, lr: float, momentum: float, weight_decay: float) -> None:
    """In place, torch's SGD: v = momentum * v + grad + weight_decay * param;  param -= lr * v."""
    velocity *= momentum
    velocity += grad
    if weight_decay:
        velocity += weight_decay * param
    param -= lr * velocity


# An optimisation: sgd_update_plain walks all of param, grad and velocity five times and makes two
# param-sized temporaries (conv2 of 500:1500 is 75 MB: 72 ms a step on one core, while a worker waits).
# Block by block, the five passes run while the block is in the L2 cache (4 arrays of 256 KB).
SGD_BLOCK = 1 << 16


def sgd_update(param, grad, velocity, lr: float, momentum: float, weight_decay: float, block: int = SGD_BLOCK) -> None:
    """sgd_update_plain's result, bit for bit: the same float operations in the same order on each
    element, only run on one block of elements at a time."""
    if not (param.flags.c_contiguous and velocity.flags.c_contiguous and grad.size == param.size):
        return sgd_update_plain(param, grad, velocity, lr, momentum, weight_decay)
    p, g, v = param.reshape(-1), grad.reshape(-1), velocity.reshape(-1)  # views (grad: a copy if strided)
    scratch = np.empty(min(block, p.size), param.dtype)
    for a in range(0, p.size, block):
        e = min(a + block, p.size)
        pb, vb, s = p[a:e], v[a:e], scratch[: e - a]
        vb *= momentum
        vb += g[a:e]
        if weight_decay:
            vb += np.multiply(pb, weight_decay, out=s)
        pb -= np.multiply(vb, lr, out=s)
    return None


class NumpyBackend(Backend):
    """The reference backend. Arrays are plain float32 numpy arrays on the host."""

    name = "numpy"

    def __init__(self, **_: Any) -> None:
        pass

    # ---- edges -------------------------------------------------------------
    def asarray(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        return np.ascontiguousarray(x, dtype=F32 if x.dtype.kind == "f" else None)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=F32)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": _cpu_name(),
            "kind": "cpu",
            "compute_units": os.cpu_count() or 1,
            "numpy": np.__version__,
        }

    # ---- convolution ---------------------------------------------------------
    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        y, cache = self._conv_gemm(x, w, stride, padding)  # (F, N, OH, OW)
        y += b[:, None, None, None]
        return np.ascontiguousarray(y.transpose(1, 0, 2, 3)), cache

    def conv2d_partial(self, x, w, stride=1, padding=0):
        if type(self).conv2d_forward is not NumpyBackend.conv2d_forward:
            # a subclass with a convolution of its own (examples/threaded_backend): P is made by it
            return super().conv2d_partial(x, w, stride, padding)
        # An optimisation of the base's: the GEMM leaves (F, N*OH*OW), kernel-major already, so
        # neither the transpose nor a bias pass is made
        return self._conv_gemm(x, w, stride, padding)

    def _conv_gemm(self, x, w, stride, padding):
        """x (N, C, H, W), w (F, C, KH, KW) -> (W2 @ cols as (F, N, OH, OW), conv2d_backward's cache)."""
        n = x.shape[0]
        f, c, kh, kw = w.shape
        if x.ndim != 4 or x.shape[1] != c:
            raise ValueError(f"conv2d: input {x.shape} does not match weights {w.shape} (N, C, H, W)")
        oh = conv_output_size(x.shape[2], kh, stride, padding)
        ow = conv_output_size(x.shape[3], kw, stride, padding)
        cols = im2col(x, kh, kw, stride, padding)
        y2 = w.reshape(f, -1) @ cols  # (F, N*OH*OW)
        return y2.reshape(f, n, oh, ow), (x.shape, w, cols, stride, padding)

    def conv2d_backward(self, dy, cache, need_dx=True):
        x_shape, w, cols, stride, padding = cache
        f, c, kh, kw = w.shape
        dy2 = dy.transpose(1, 0, 2, 3).reshape(f, -1)  # (F, N*OH*OW): one copy, none of a kernel-major dY
        # dW^T = cols dY^T rather than dW = dY cols^T: the same sums, but OpenBLAS runs this shape (a
        # small output, K = N*OH*OW long) 1.1-4x faster so, the most with 2 threads (bench_train_step.py);
        # transposed back into a C-contiguous dW, since the optimiser's update and the wire would
        # otherwise each walk the transposed view a cache miss per float
        dw = transposed(cols @ dy2.T).reshape(w.shape)
        db = dy2.sum(axis=1)
        dx = None
        if need_dx:
            dcols = w.reshape(f, -1).T @ dy2  # our own temporary: col2im may zero terms in it
            dx = col2im(dcols, x_shape, kh, kw, stride, padding, overwrite_dcols=True)
        return dx, dw, db

    # ---- elementwise and normalisation ----------------------------------------
    def relu_forward(self, x):
        y = np.maximum(x, 0)
        return y, y

    def relu_backward(self, dy, cache):
        return dy * (cache > 0)

    # Every pass of the LRN writes in place (``out=``): on maps of tens of MB a freshly allocated
    # array costs about as much again in page faults.
    def lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        before, after = size // 2, (size - 1) // 2
        s, p, y = (np.empty_like(x) for _ in range(3))
        np.multiply(x, x, out=y)  # y is written last, so it is the scratch until then: one map fewer at the peak
        _channel_window_sum(y, before, after, out=s)
        s *= alpha / size
        s += k  # s = k + alpha/size * (window sum of x^2)
        if beta == 0.75:  # p = s^-beta by square roots, 5x faster than pow
            np.sqrt(s, out=p)
            np.divide(1.0, p, out=p)  # r = s^-1/2
            np.sqrt(p, out=y)
            p *= y  # r * r^1/2 = s^-3/4
        else:
            np.power(s, -beta, out=p)
        np.multiply(x, p, out=y)
        return y, (x, y, s, p, size, alpha, beta, before, after)

    def lrn_backward(self, dy, cache):
        """dx = dy * p - (2 alpha beta / size) * x * T(dy * y / s). y_i depends on x_j for every j in
        window(i), so T sums over {i : j in window(i)}: the transposed window, before and after swapped."""
        x, y, s, p, size, alpha, beta, before, after = cache
        dx, scratch = np.empty_like(dy), np.empty_like(dy)
        np.multiply(dy, y, out=scratch)
        scratch /= s
        _channel_window_sum(scratch, after, before, out=dx)
        dx *= x
        dx *= -2.0 * alpha * beta / size
        np.multiply(dy, p, out=scratch)
        dx += scratch
        return dx

    # Batch norm, an optimisation (batchnorm_forward_plain / batchnorm_backward_plain above are the same
    # math written out; tests/test_batchnorm_numpy.py holds the two together): each map-sized pass writes
    # into one of two buffers (xhat and y; dx in the backward), as the LRN does, the per-channel constants
    # are folded first, and eval mode is one affine pass. The variance stays two-pass (centred squares), since
    # E[x^2] - mean^2 cancels in float32.
    def batchnorm_forward(self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
        if not training:  # a fixed affine map: y = x * scale + shift, one pass and one array
            invstd = 1.0 / np.sqrt(running_var + eps)
            scale = gamma * invstd
            y = np.multiply(x, scale[None, :, None, None])
            y += (beta - running_mean * scale)[None, :, None, None]
            return y, (x, running_mean.copy(), gamma, invstd, False)
        require_batch_statistics(x.shape)
        n, c, h, w = x.shape
        m = n * h * w
        mean = _channel_sum(x) / F32(m)
        xhat = np.subtract(x, mean[None, :, None, None])  # x - mean, scaled to xhat below
        y = np.multiply(xhat, xhat)  # the squares, in y's buffer until y is written
        var = _channel_sum(y) / F32(m)
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += (momentum * m / max(m - 1, 1)) * var
        invstd = 1.0 / np.sqrt(var + eps)
        xhat *= invstd[None, :, None, None]
        np.multiply(xhat, gamma[None, :, None, None], out=y)
        y += beta[None, :, None, None]
        return y, (xhat, None, gamma, invstd, True)

    def batchnorm_backward(self, dy, cache):
        xhat, mean, gamma, invstd, training = cache
        g = gamma * invstd
        if not training:  # statistics are constants in eval mode; cache holds x, not xhat
            x = xhat
            dbeta = _channel_sum(dy)
            dx = np.subtract(x, mean[None, :, None, None])
            dx *= invstd[None, :, None, None]  # xhat, in dx's buffer
            dx *= dy
            dgamma = _channel_sum(dx)
            np.multiply(dy, g[None, :, None, None], out=dx)
            return dx, dgamma, dbeta
        m = F32(dy.shape[0] * dy.shape[2] * dy.shape[3])
        dbeta = _channel_sum(dy)
        dx = np.multiply(dy, xhat)  # dy * xhat, in dx's buffer
        dgamma = _channel_sum(dx)
        # dx = g (dy - dbeta/m - xhat dgamma/m), four passes in dx's buffer
        np.multiply(xhat, (-dgamma / m)[None, :, None, None], out=dx)
        dx += dy
        dx -= (dbeta / m)[None, :, None, None]
        dx *= g[None, :, None, None]
        return dx, dgamma, dbeta

    # ---- pooling -------------------------------------------------------------
    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        return numpy_maxpool.maxpool_forward(x, kernel, stride, padding)

    def maxpool_backward(self, dy, cache):
        return numpy_maxpool.maxpool_backward(dy, cache)

    # ---- dense -----------------------------------------------------------------
    def linear_forward(self, x, w, b):
        x2 = x.reshape(x.shape[0], -1)
        if x2.shape[1] != w.shape[1]:
            raise ValueError(f"linear: input {x.shape} flattens to {x2.shape[1]}, weights expect {w.shape[1]}")
        return x2 @ w.T + b, (x.shape, x2, w)

    def linear_backward(self, dy, cache):
        x_shape, x2, w = cache
        return (dy @ w).reshape(x_shape), dy.T @ x2, dy.sum(axis=0)

    def softmax_cross_entropy(self, logits, labels):
        labels = np.asarray(labels)
        n, k = logits.shape
        check_labels(labels, n, k)
        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        se = e.sum(axis=1, keepdims=True)
        rows = np.arange(n)
        loss = float(np.mean(np.log(se[:, 0]) - z[rows, labels]))
        d = e / se
        d[rows, labels] -= 1
        d /= n
        return loss, d

    # ---- optimiser ---------------------------------------------------------------
    def sgd_update(self, param, grad, velocity, lr, momentum, weight_decay):
        sgd_update(param, grad, velocity, lr, momentum, weight_decay)
