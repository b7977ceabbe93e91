"""The backward of absolute values: the scale of a backward's round-off, entry by entry.

A float32 backward's result is off by at most gamma_k of the same backward taken in absolute values, k the
roundings on its longest path (the classical bound for a product of matrices, |fl(J^T d) - J^T d| <= gamma_k
|J|^T |d|; the forward's round-off moves each Jacobian entry by at most gamma of the absolute values it is made
of, and k counts the forward's roundings too). Where a backward cancels -- batch norm subtracts two means from
dy, a dX GEMM sums terms of both signs -- its result is far smaller than that scale, and so a bound on the
result's own scale is not one. Each layer, from A_y (the magnitudes of dL/d its output) to A_x, and its
parameters' A:

    convolution   A_x = col2im(|W|^T A_y)     A_W = A_y |cols|^T   A_b = sum A_y
    linear        A_x = A_y |W|               A_W = A_y^T |x|      A_b = sum_n A_y
    ReLU          A_x = A_y [x > 0]           max pool: A_y to the value each window took
    LRN           A_x = A_y s^-beta + (2 alpha beta / size) |x| T(A_y |x| s^(-beta-1))   (T: the window's transpose)
    batch norm    A_x = |gamma| / std (A_y + B + |xhat| G),   A_gamma = sum A_y |xhat|,   A_beta = sum A_y

Batch norm's B and G are the means over the M = n H W values of a channel of what its backward subtracts: of
A_y and A_y |xhat| over the slice, or, for one image of a slice whose sums dbeta and dgamma the worker sent,
|dbeta| / M and |dgamma| / M (``image_backward.py``). Its mean and std are the layer's running statistics: the
checks load the slice's batch statistics there, so that an evaluation forward normalises as training did.
"""

from __future__ import annotations

import numpy as np

from backends.numpy_backend import NumpyBackend
from backends.numpy_columns import col2im, im2col
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.conv_part import conv_part
from tinyconv.distributed.replica.free_checks import targets
from tinyconv.distributed.replica.one_image import slice_statistics
from tinyconv.layers import BatchNorm2D, Conv2D, Layer, Linear, LocalResponseNorm, MaxPool2D, ReLU
from tinyconv.model import Network
from transports.base import Message


def magnitude(
    layer: Layer, x: np.ndarray, a: np.ndarray, sums: tuple | None = None, images: int = 0, params: bool = False
) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """A_x of ``layer`` from its input x and A_y ``a`` (host, >= 0), and with ``params`` its parameters' A (the
    module's table; None for A_x of a convolution that computes no dX). Batch norm: ``sums`` (dbeta, dgamma) of
    a slice of ``images`` images, or None for the means over x's own."""
    host = lambda name: np.abs(np.asarray(layer.backend.to_numpy(layer.params[name]), np.float32))  # noqa: E731
    if isinstance(layer, Conv2D):
        w = host("w")
        f, _, kh, kw = w.shape
        a2 = a.transpose(1, 0, 2, 3).reshape(f, -1)
        ax = None
        if layer.need_dx:
            ax = col2im(w.reshape(f, -1).T @ a2, x.shape, kh, kw, layer.stride, layer.padding, overwrite_dcols=True)
        if not params:
            return ax, {}
        cols = im2col(np.abs(x), kh, kw, layer.stride, layer.padding)
        return ax, {"w": (a2 @ cols.T).reshape(w.shape), "b": a2.sum(axis=1)}
    if isinstance(layer, Linear):
        w, x2 = host("w"), np.abs(x.reshape(len(x), -1))
        return (a @ w).reshape(x.shape), ({"w": a.T @ x2, "b": a.sum(axis=0)} if params else {})
    if isinstance(layer, ReLU):
        return a * (x > 0), {}
    if isinstance(layer, MaxPool2D):
        be = NumpyBackend()
        return be.maxpool_backward(a, be.maxpool_forward(x, layer.kernel, layer.stride, layer.padding)[1]), {}
    if isinstance(layer, LocalResponseNorm):
        size, before, after = layer.size, layer.size // 2, (layer.size - 1) // 2
        s = layer.k + layer.alpha / size * _window(x * x, before, after)
        z = a * np.abs(x) * s ** (-layer.beta - 1)
        return a * s**-layer.beta + 2 * layer.alpha * layer.beta / size * np.abs(x) * _window(z, after, before), {}
    if isinstance(layer, BatchNorm2D):
        shape = (1, -1, 1, 1)
        invstd, xhat = normalised(layer, x)
        xhat = np.abs(xhat)
        if sums is None:
            b, g = a.mean(axis=(0, 2, 3), keepdims=True), (a * xhat).mean(axis=(0, 2, 3), keepdims=True)
        else:
            m = np.float32(images * x.shape[2] * x.shape[3])
            b, g = (np.abs(v).reshape(shape) / m for v in sums)
        ax = (host("gamma").reshape(shape) * invstd * (a + b + xhat * g)).astype(np.float32)
        return ax, ({"gamma": (a * xhat).sum(axis=(0, 2, 3)), "beta": a.sum(axis=(0, 2, 3))} if params else {})
    raise ValueError(f"no backward in absolute values for {layer!r}")


def normalised(norm: BatchNorm2D, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1 / std (1, C, 1, 1) and xhat = (x - mean) / std of x (n, C, H, W) at the norm's running statistics (the
    slice's batch ones, as the checks load them), float32."""
    mean, var = (
        np.asarray(norm.backend.to_numpy(norm.buffers[b])).reshape(1, -1, 1, 1) for b in ("running_mean", "running_var")
    )
    invstd = (1 / np.sqrt(var + np.float32(norm.eps))).astype(np.float32)
    return invstd, (x - mean) * invstd


def of_gradient(net: Network, x: np.ndarray, a: np.ndarray) -> dict[str, np.ndarray]:
    """Each parameter's A ('conv1.w': an array of its shape) of ``net`` (its weights and, as running statistics,
    the slice's batch ones loaded) on the slice x (n, C, H, W), from ``a``, the magnitudes of dL/d its output."""
    h, inputs = x, []
    for layer in net.layers:
        inputs.append(h)
        h = np.asarray(net.backend.to_numpy(layer.forward(net.backend.asarray(h), training=False)), np.float32)
    out: dict[str, np.ndarray] = {}
    a = np.asarray(a, np.float32).reshape(h.shape)
    for layer, xin in zip(reversed(net.layers), reversed(inputs), strict=True):
        a, grads = magnitude(layer, xin, a, params=True)
        out |= {f"{layer.name}.{name}": g for name, g in grads.items()}
        if a is None:
            break
    return out


def of_task(net: Network, got: list[tuple[Message, Message]]) -> dict[str, np.ndarray]:
    """Each parameter's A of a worker's replica task (``got``: its tasks and answers), by ``net``, the replica on
    numpy, at the worker's batch statistics: from (p + q) / N of the logits it sent, or the magnitudes of the
    dL/dfeatures it got (the hybrid's conv part)."""
    first, answer = got[0]
    part = net if first.kind == "replica_step" else conv_part(net)
    flat.unpack(part, first.arrays["params"])
    x = first.arrays["x"]
    slice_statistics(part, answer.arrays.get("stats"), x.shape)
    if first.kind == "hybrid_forward":
        return of_gradient(part, x, np.abs(got[1][0].arrays["dfeatures"]))
    h = first.header
    p, q = targets(answer.arrays["logits"], first.arrays["y"], float(h.get("smoothing", 0.0)))
    return of_gradient(part, x, (p + q) / h["batch"])


def _window(z: np.ndarray, before: int, after: int) -> np.ndarray:
    """sum_{j in [i - before, i + after]} z[:, j] for each channel i of z (N, C, H, W), past the edges 0."""
    out, c = np.zeros_like(z), z.shape[1]
    for d in range(-before, after + 1):
        lo, hi = max(0, -d), min(c, c - d)
        out[:, lo:hi] += z[:, lo + d : hi + d]
    return out
