"""The OpenCL backend's normalisations: LRN, ReLU and LRN fused, and batch norm, forward and backward.

Each is a few kernels of ops.cl launched through the ClRuntime's launchers (``planes``, ``channel_walk``,
``channel_sums``), doing the numpy reference's arithmetic in the same order.
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


def lrn_forward(
    rt: ClRuntime, x: cla.Array, size: int, alpha: float, beta: float, k: float, relu: bool = False
) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W) -> y = r * s^-beta, s = k + alpha/size * (sum of r^2 over the channel window),
    r = x, or with ``relu`` r = max(x, 0): ReLU then LRN as one kernel (an optimisation beside the
    two, which stay: ops.cl reads the map once and writes it once). The fused cache holds the ReLU's
    input x, not r, and s but not p = s^-beta: the backward recomputes both, so neither is written."""
    x = rt.operand(x, "lrn x")
    if x.ndim != 4 or size < 1:
        raise ValueError(f"lrn: expected an (N, C, H, W) input and size >= 1, got {x.shape} and {size}")
    before, after = size // 2, (size - 1) // 2
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    maps = [rt.empty(x.shape) for _ in range(2 if relu else 3)]  # y, s and (plain LRN) p
    constants = (i32(c), i32(hw), i32(n), F32(alpha / size), F32(k), F32(beta))
    name, build = "relu_lrn_forward" if relu else "lrn_forward", lrn_defines(before, after, beta)
    rt.planes(name, n, c, hw, x.data, *constants, *(a.data for a in maps), defines=build)
    return maps[0], (relu, x, maps, size, alpha, beta, before, after)


def lrn_backward(rt: ClRuntime, dy: cla.Array, cache: Cache) -> cla.Array:
    """dy (N, C, H, W) -> dx, through the LRN (and then the ReLU, for the fused op's cache)."""
    relu, x, maps, size, alpha, beta, before, after = cache
    dy = rt.operand(dy, "lrn dy")
    if dy.shape != x.shape:
        raise ValueError(f"lrn_backward: dy {dy.shape} does not match the forward input {x.shape}")
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    dx = rt.empty(x.shape)
    inputs = (dy.data, x.data, *(a.data for a in maps))
    scale = F32(2.0 * alpha * beta / size)
    constants = (i32(c), i32(hw), i32(n), F32(beta), scale) if relu else (i32(c), i32(hw), i32(n), scale)
    name, build = "relu_lrn_backward" if relu else "lrn_backward", lrn_defines(before, after, beta)
    rt.channel_walk(name, n, c, hw, *inputs, *constants, dx.data, defines=build)
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
