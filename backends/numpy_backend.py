"""The numpy reference backend: every op vectorised, convolution as im2col + one GEMM.

Ops compute in their inputs' dtype (float32 in training; float64 arrays passed
straight to the ops stay float64, which is how tinyconv/gradcheck.py checks them).
No Python loop runs over single images, pixels or channels, only over a window's offsets
and, in the optimised ops, over blocks of the maps (BLOCK values, to run a few passes in cache).

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
# An optimisation several ops share: each of numpy's passes over a map of tens of MB reads it from memory,
# while a block of BLOCK float32 (256 KB) stays in the L2 cache; so an op runs all its passes over one block
# before the next (numpy_maxpool.py's BLOCK too; the gain is measured at each op)
BLOCK = 1 << 16


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


def _blocks(x: np.ndarray) -> tuple[np.ndarray, list[tuple[slice, slice]]]:
    """An (N, C, H, W) map as (N, C, H*W), and the blocks of about BLOCK values a pass run block by block
    takes in turn, as (samples, channels) slices: whole samples when one fits, else runs of one's channels."""
    n, c, h, w = x.shape
    samples, channels = max(1, BLOCK // (c * h * w)), c if c * h * w <= BLOCK else max(1, BLOCK // (h * w))
    blocks = [
        (slice(i, i + samples), slice(j, j + channels)) for i in range(0, n, samples) for j in range(0, c, channels)
    ]
    return x.reshape(n, c, h * w), blocks


def _planes(hw: int, *per_channel: np.ndarray) -> list[np.ndarray]:
    """Per-channel (C,) vectors spread over a sample, (C, H*W) each. An optimisation: numpy runs an op on
    a block and a plane of its shape (broadcast over the block's samples) ~2x faster than one broadcasting
    a (C, 1) column along each row."""
    return [np.repeat(v[:, None], hw, axis=1) for v in per_channel]


def _channel_sum(a: np.ndarray) -> np.ndarray:
    """Per-channel sum of an (N, C, H, W) map: (C,), in a's dtype.

    The N*C rows of H*W values are summed by one matrix-vector product with ones (BLAS, ~4x numpy's
    pairwise sum on these maps, both BLAS threads), then the N row sums of each channel one after the
    other. In whatever order BLAS adds a row, a value passes through at most d = H*W + N roundings, so
    |error| <= d * 2^-24 * sum |a| (to first order; tests/test_batchnorm_numpy.py checks it against float64).
    """
    n, c, h, w = a.shape
    return (a.reshape(n * c, h * w) @ np.ones(h * w, a.dtype)).reshape(n, c).sum(axis=0)


def _channel_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per channel, the sum over (N, H, W) of a * b, two (N, C, H, W) maps: (C,). Each (sample, channel) row
    of H*W is one BLAS dot product (np.matmul of (1, H*W) by (H*W, 1); np.vecdot from numpy 2), and no map
    of products is made; then the N row sums in order. At most H*W + N + 1 roundings a term."""
    n, c, h, w = a.shape
    return np.matmul(a.reshape(n, c, 1, h * w), b.reshape(n, c, h * w, 1)).reshape(n, c).sum(axis=0)


def _centred_square_sum(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Per channel, the sum over (N, H, W) of (x - mean)^2: (C,). Block by block: x - mean is made in
    cache, never as a map, and summed by dot products as _channel_dot sums."""
    x3, blocks = _blocks(x)
    (mu,) = _planes(x3.shape[2], mean)
    sums, scratch = np.empty(x3.shape[:2], x.dtype), np.empty_like(x3[blocks[0]])
    for i, j in blocks:
        xb = x3[i, j]
        xc = np.subtract(xb, mu[j], out=scratch[: xb.shape[0], : xb.shape[1]])
        np.matmul(xc[..., None, :], xc[..., None], out=sums[i, j, None, None])
    return sums.sum(axis=0)


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
# Block by block (BLOCK values), the five passes run while the block is in the L2 cache (4 arrays of 256 KB).
def sgd_update(param, grad, velocity, lr: float, momentum: float, weight_decay: float, block: int = BLOCK) -> None:
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

    # Every pass of the LRN writes in place (``out=``): on maps of tens of MB a freshly allocated array costs
    # about as much again in page faults. An optimisation: all the passes run over one block of whole samples
    # (the window runs along the channels) before the next, while it is in cache (1.3-1.9x forward, 1.5-2.2x
    # backward on 50:500's maps at batch 64 and 256, bench_numpy_ops.py --arch 50:500 --ops lrn).
    def lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        before, after = size // 2, (size - 1) // 2
        s, p, y = (np.empty_like(x) for _ in range(3))
        step = max(1, BLOCK // x[0].size)
        for b in (slice(i, i + step) for i in range(0, len(x), step)):
            xb, sb, pb, yb = x[b], s[b], p[b], y[b]
            np.multiply(xb, xb, out=yb)  # y is written last, so it is the scratch until then: one map fewer
            _channel_window_sum(yb, before, after, out=sb)
            sb *= alpha / size
            sb += k  # s = k + alpha/size * (window sum of x^2)
            if beta == 0.75:  # p = s^-beta by square roots, 5x faster than pow
                np.sqrt(sb, out=pb)
                np.divide(1.0, pb, out=pb)  # r = s^-1/2
                np.sqrt(pb, out=yb)
                pb *= yb  # r * r^1/2 = s^-3/4
            else:
                np.power(sb, -beta, out=pb)
            np.multiply(xb, pb, out=yb)
        return y, (x, y, s, p, size, alpha, beta, before, after)

    def lrn_backward(self, dy, cache):
        """dx = dy * p - (2 alpha beta / size) * x * T(dy * y / s). y_i depends on x_j for every j in
        window(i), so T sums over {i : j in window(i)}: the transposed window, before and after swapped."""
        x, y, s, p, size, alpha, beta, before, after = cache
        dx, step = np.empty_like(dy), max(1, BLOCK // dy[0].size)
        scratch = np.empty_like(dy[:step])
        for b in (slice(i, i + step) for i in range(0, len(dy), step)):
            dxb, t = dx[b], scratch[: len(dx[b])]
            np.multiply(dy[b], y[b], out=t)
            t /= s[b]
            _channel_window_sum(t, after, before, out=dxb)
            dxb *= x[b]
            dxb *= -2.0 * alpha * beta / size
            dxb += np.multiply(dy[b], p[b], out=t)
        return dx

    # Batch norm, an optimisation (batchnorm_forward_plain / batchnorm_backward_plain above are the same math
    # written out; tests/test_batchnorm_numpy.py holds them together): the sums are BLAS products
    # (_channel_sum, _centred_square_sum, _channel_dot), and each map-sized pass runs block by block while the
    # block is in cache, against per-channel constants spread over a sample (_planes): 1.5-1.6x forward,
    # 1.6-2x backward on 50:500's maps at batch 64 and 256 (bench_numpy_ops.py --arch 50:500 --ops batchnorm).
    # The variance stays two-pass (centred squares), since E[x^2] - mean^2 cancels in float32.
    def batchnorm_forward(self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
        mean, var = running_mean, running_var  # eval: the running statistics, constants
        if training:
            require_batch_statistics(x.shape)
            m = x.shape[0] * x.shape[2] * x.shape[3]
            mean = _channel_sum(x) / F32(m)
            var = _centred_square_sum(x, mean) / F32(m)
            running_mean *= 1 - momentum
            running_mean += momentum * mean
            running_var *= 1 - momentum
            running_var += (momentum * m / max(m - 1, 1)) * var
        invstd = 1.0 / np.sqrt(var + eps)
        x3, blocks = _blocks(x)
        xh3, y3 = np.empty(x3.shape, x.dtype), np.empty(x3.shape, x.dtype)  # xhat and y, C-contiguous
        mu, s, g, b = _planes(x3.shape[2], mean, invstd, gamma, beta)
        for i, j in blocks:  # xhat = (x - mean) * invstd, y = xhat * gamma + beta
            xh = np.subtract(x3[i, j], mu[j], out=xh3[i, j])
            xh *= s[j]
            np.multiply(xh, g[j], out=y3[i, j])
            y3[i, j] += b[j]
        return y3.reshape(x.shape), (xh3.reshape(x.shape), gamma, invstd, training)

    def batchnorm_backward(self, dy, cache):
        xhat, gamma, invstd, training = cache
        g = gamma * invstd
        dbeta, dgamma = _channel_sum(dy), _channel_dot(dy, xhat)
        if not training:  # statistics are constants in eval mode
            return dy * g[None, :, None, None], dgamma, dbeta
        m = F32(dy.shape[0] * dy.shape[2] * dy.shape[3])
        xh3, blocks = _blocks(xhat)
        dx3, dy3 = np.empty(xh3.shape, dy.dtype), dy.reshape(xh3.shape)
        k, c, gp = _planes(xh3.shape[2], -dgamma / m, dbeta / m, g)
        for i, j in blocks:  # dx = g (dy - dbeta/m - xhat dgamma/m), four passes in dx's buffer
            d = np.multiply(xh3[i, j], k[j], out=dx3[i, j])
            d += dy3[i, j]
            d -= c[j]
            d *= gp[j]
        return dx3.reshape(dy.shape), dgamma, dbeta

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
