"""The numpy backend's optimised ops written out plainly: the oracles the tests hold them to.

batchnorm_*_plain: a fresh array per step of BatchNorm2D's math (tests/test_batchnorm_numpy.py).
maxpool_*_plain: every window copied out as a row, and its argmax (tests/test_numpy_strided.py).
"""

from __future__ import annotations

import numpy as np

from backends.base import conv_output_size, require_batch_statistics


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


def maxpool_forward_plain(x: np.ndarray, kernel: int, stride: int, padding: int) -> tuple[np.ndarray, tuple]:
    """Max pool written out (backends/numpy_maxpool.py's maxpool_forward is the optimised twin; same contract).

    Every window is copied out of x padded with -inf as a row of kernel*kernel values, (N, C, OH,
    OW, K*K), and ``sel`` is the index in the row of the input the window selects: its first
    maximum in row-major order among the inputs inside the image, or its last NaN if it holds one.
    Returns y (N, C, OH, OW) and the cache (x's shape, sel, kernel, stride, padding).
    """
    n, c, h, w = x.shape
    oh = conv_output_size(h, kernel, stride, padding)
    ow = conv_output_size(w, kernel, stride, padding)
    pad = ((0, 0), (0, 0), (padding, padding), (padding, padding))
    xp = np.pad(x, pad, constant_values=-np.inf)
    inside = np.pad(np.ones((h, w), bool), pad[2:])
    k2 = kernel * kernel
    windows = np.lib.stride_tricks.sliding_window_view(xp, (kernel, kernel), axis=(2, 3))
    windows = windows[:, :, ::stride, ::stride].reshape(n, c, oh, ow, k2)
    inside = np.lib.stride_tricks.sliding_window_view(inside, (kernel, kernel))[::stride, ::stride].reshape(oh, ow, k2)
    y = windows.max(axis=-1)  # NaN wherever the window holds one
    sel = np.argmax((windows == y[..., None]) & inside, axis=-1)  # first True: first maximum inside
    nan = np.isnan(windows)
    last_nan = k2 - 1 - np.argmax(nan[..., ::-1], axis=-1)
    sel = np.where(nan.any(axis=-1), last_nan, sel)
    return y, (x.shape, sel, kernel, stride, padding)


def maxpool_backward_plain(dy: np.ndarray, cache: tuple) -> np.ndarray:
    """dx for maxpool_forward_plain: each dy added to the input its window selected, overlaps summed."""
    (n, c, h, w), sel, kernel, stride, padding = cache
    oh, ow = dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=dy.dtype)
    for i in range(kernel):
        for j in range(kernel):
            dxp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += dy * (sel == i * kernel + j)
    return dxp[:, :, padding : padding + h, padding : padding + w].copy()
