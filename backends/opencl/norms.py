"""The OpenCL backend's normalisations: LRN, ReLU and LRN fused, and batch norm, forward and backward.

Each is a few kernels of ops.cl launched through the ClRuntime's shared launchers: ``rt.planes``
(per pixel, or a plane per work-item on CPUs), ``rt.channel_walk`` (LRN's backward: on CPUs a
work-item walks the channels of a block of pixels) and ``rt.channel_sums`` (batch norm's
per-channel statistics and gradients). The arithmetic is the numpy reference's
(backends/numpy_backend.py), in the same order.
"""

from __future__ import annotations

import numpy as np
import pyopencl.array as cla

from backends.base import Cache, require_batch_statistics
from backends.opencl.cl_runtime import ClRuntime

F32 = np.float32
i32 = np.int32


def lrn_defines(before: int, after: int, beta: float) -> str:
    """The LRN kernels' build: the window, and whether s^-beta is done by square roots (see ops.cl)."""
    return f"-DLRN_BEFORE={before} -DLRN_AFTER={after} -DLRN_BETA_075={int(beta == 0.75)}"


def _lrn_input(rt: ClRuntime, x: cla.Array, size: int, what: str) -> cla.Array:
    x = rt.operand(x, f"{what} x")
    if x.ndim != 4 or size < 1:
        raise ValueError(f"{what}: expected an (N, C, H, W) input and size >= 1, got {x.shape} and {size}")
    return x


def _lrn_dy(rt: ClRuntime, dy: cla.Array, x: cla.Array, what: str) -> cla.Array:
    dy = rt.operand(dy, f"{what} dy")
    if dy.shape != x.shape:
        raise ValueError(f"{what}_backward: dy {dy.shape} does not match the forward input {x.shape}")
    return dy


def lrn_forward(
    rt: ClRuntime, x: cla.Array, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W) -> y = x * s^-beta, s = k + alpha/size * (sum of x^2 over the channel window)."""
    x = _lrn_input(rt, x, size, "lrn")
    before, after = size // 2, (size - 1) // 2
    build = lrn_defines(before, after, beta)
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    y, s, p = rt.empty(x.shape), rt.empty(x.shape), rt.empty(x.shape)
    constants = (i32(c), i32(hw), i32(n), F32(alpha / size), F32(k), F32(beta))
    outputs = (y.data, s.data, p.data)
    rt.planes("lrn_forward", n, c, hw, x.data, *constants, *outputs, defines=build)
    return y, (x, y, s, p, size, alpha, beta, before, after)


def lrn_backward(rt: ClRuntime, dy: cla.Array, cache: Cache) -> cla.Array:
    """dy (N, C, H, W) -> dx."""
    x, y, s, p, size, alpha, beta, before, after = cache
    build = lrn_defines(before, after, beta)
    dy = _lrn_dy(rt, dy, x, "lrn")
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    dx = rt.empty(x.shape)
    inputs = (dy.data, x.data, y.data, s.data, p.data)
    constants = (i32(c), i32(hw), i32(n), F32(2.0 * alpha * beta / size))
    rt.channel_walk("lrn_backward", n, c, hw, *inputs, *constants, dx.data, defines=build)
    return dx


# An optimisation beside relu_* and lrn_*, which stay: ReLU then LRN as one kernel each way
# (ops.cl: read the map once, write it once). The cache holds the ReLU's input x, not its
# output, and s but not p = s^-beta: the backward recomputes both, so neither is ever written.
def relu_lrn_forward(
    rt: ClRuntime, x: cla.Array, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W) -> y = lrn(relu(x))."""
    x = _lrn_input(rt, x, size, "relu_lrn")
    before, after = size // 2, (size - 1) // 2
    build = lrn_defines(before, after, beta)
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    y, s = rt.empty(x.shape), rt.empty(x.shape)
    constants = (i32(c), i32(hw), i32(n), F32(alpha / size), F32(k), F32(beta))
    rt.planes("relu_lrn_forward", n, c, hw, x.data, *constants, y.data, s.data, defines=build)
    return y, (x, y, s, size, alpha, beta, before, after)


def relu_lrn_backward(rt: ClRuntime, dy: cla.Array, cache: Cache) -> cla.Array:
    """dy (N, C, H, W) -> dx, through the LRN and then the ReLU."""
    x, y, s, size, alpha, beta, before, after = cache
    build = lrn_defines(before, after, beta)
    dy = _lrn_dy(rt, dy, x, "relu_lrn")
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    dx = rt.empty(x.shape)
    constants = (i32(c), i32(hw), i32(n), F32(beta), F32(2.0 * alpha * beta / size))
    inputs = (dy.data, x.data, y.data, s.data)
    rt.channel_walk("relu_lrn_backward", n, c, hw, *inputs, *constants, dx.data, defines=build)
    return dx


def batchnorm_forward(
    rt: ClRuntime,
    x: cla.Array,
    gamma: cla.Array,
    beta: cla.Array,
    running_mean: cla.Array,
    running_var: cla.Array,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W), gamma, beta and the running statistics (C,) -> y; in training the batch's
    statistics normalise and update the running ones in place, otherwise the running ones normalise."""
    x = rt.operand(x, "batchnorm x")
    if x.ndim != 4:
        raise ValueError(f"batchnorm: expected an (N, C, H, W) input, got {x.shape}")
    gamma, beta = rt.operand(gamma, "batchnorm gamma"), rt.operand(beta, "batchnorm beta")
    running_mean = rt.operand(running_mean, "batchnorm running_mean", in_place=True)
    running_var = rt.operand(running_var, "batchnorm running_var", in_place=True)
    n, c, h, w = x.shape
    if any(a.shape != (c,) for a in (gamma, beta, running_mean, running_var)):
        raise ValueError(f"batchnorm: gamma, beta and the running statistics must be ({c},) for an input {x.shape}")
    hw, m = h * w, n * h * w
    if training:
        require_batch_statistics(x.shape)
        mean = rt.channel_sums(x, n, c, hw, divisor=m)
        var = rt.channel_sums(x, n, c, hw, mode=2, center=mean, divisor=m)
        unbiased = momentum * m / max(m - 1, 1)  # the running variance is the unbiased one
        running = (running_mean.data, running_var.data, mean.data, var.data)
        rt.launch("bn_update_running", c, *running, i32(c), F32(1 - momentum), F32(momentum), F32(unbiased))
    else:
        mean, var = running_mean, running_var
    invstd = rt.empty((c,))
    rt.launch("bn_invstd", c, var.data, F32(eps), i32(c), invstd.data)
    xhat, y = rt.empty(x.shape), rt.empty(x.shape)
    per_channel = (mean.data, invstd.data, gamma.data, beta.data)
    rt.planes("bn_forward", n, c, hw, x.data, *per_channel, i32(c), i32(hw), i32(n), xhat.data, y.data)
    return y, (xhat, gamma, invstd, training)


def batchnorm_backward(rt: ClRuntime, dy: cla.Array, cache: Cache) -> tuple[cla.Array, cla.Array, cla.Array]:
    """dy (N, C, H, W) -> (dx, dgamma (C,), dbeta (C,))."""
    xhat, gamma, invstd, training = cache
    dy = rt.operand(dy, "batchnorm dy")
    n, c, h, w = dy.shape
    hw = h * w
    dbeta = rt.channel_sums(dy, n, c, hw)
    dgamma = rt.channel_sums(dy, n, c, hw, mode=1, src2=xhat)
    dx = rt.empty(dy.shape)
    inputs = (dy.data, xhat.data, gamma.data, invstd.data, dgamma.data, dbeta.data)
    constants = (i32(training), F32(n * hw), i32(c), i32(hw), i32(n))
    rt.planes("bn_backward", n, c, hw, *inputs, *constants, dx.data)
    return dx, dgamma, dbeta
