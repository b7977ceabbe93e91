"""One image's backward on the master: the check of a wrong dY that the worker's own sums follow.

A convolution's projection (``probe.py``) ties the dW a worker sent to the dY and input it saw, but not that dY
to the network: a faulty dX GEMM or norm backward bends dY, and dW and the projection's sums follow it. So the
worker also returns, for each image n and convolution, e_n = sum dY[n]^2, and the master runs one random image j
of the slice forward and backward itself and compares its e_j. A sum of squares cancels nothing: dY 1 % off
moves it 2 %.

An image's backward depends on the others only through batch norm: in training, dx = gamma / std (dy - dbeta / M
- xhat dgamma / M), M = n H W, whose sums over the slice, dbeta and dgamma, are in the gradient the worker sent.
So the master's image runs forward at the worker's batch statistics (as the image check does) and backward
with the worker's dbeta and dgamma. dL/d(output) of the image is the classifier's, (softmax(logits_j) - q_j) / N
(data parallelism), or the row of dL/dfeatures the master sent (the hybrid).

Its round-off is one image's path, not the slice's: k the roundings of the forward to the features and of the
whole backward (``roundings`` on one image; data parallelism starts from the logits the worker sent), and the
F OH OW of the sum. Where a backward cancels (batch norm's subtracts two means from dy, a dX GEMM sums terms of
both signs), its round-off is on the scale of the terms, not of dY: a second backward beside it, in absolute
values (``magnitudes.py``), gives that scale A, and e_j is held to the projections' probabilistic bound
(``probe.tolerance``, lambda sqrt(k) u in place of k u) on 2 sum |dY| A. (The rigorous gamma_k is 100 times
larger, more than the fault.) Batch norm's cancellation makes A 70 times |dY| at conv1 of 50:500, so dY 1 %
off below conv2 alone moves e_j by about its bound; the master also sums e_j's disagreements over its last
checks (``probe.Trails``). Honest disagreements, OpenCL against numpy, stayed under 0.03 of the bound.
"""

from __future__ import annotations

import math

import numpy as np

from backends.conformance.checks import FN
from tinyconv.distributed.replica import flat, probe
from tinyconv.distributed.replica.conv_part import conv_part
from tinyconv.distributed.replica.free_checks import targets
from tinyconv.distributed.replica.magnitudes import magnitude, normalised
from tinyconv.distributed.replica.one_image import roundings
from tinyconv.distributed.spot_sample import Pair, pair
from tinyconv.layers import BatchNorm2D, Conv2D
from tinyconv.model import Network
from transports.base import Message


def forward_backward(
    part: Network, x: np.ndarray, d: np.ndarray, a: np.ndarray, grads: np.ndarray, images: int
) -> tuple[np.ndarray, dict, dict, dict]:
    """Image x (1, C, H, W) through ``part`` (its weights and, as running statistics, the slice's batch ones
    loaded), forward in evaluation, then backward from ``d`` (dL/d of its output, host) and its magnitudes ``a``
    (``magnitudes.py``), batch norm in its training form at the slice's dbeta, dgamma in ``grads`` over its
    ``images`` images. Returns its output (host) and each convolution's input, output gradient and that
    gradient's magnitudes (host, by name; the first two as ``Network.forward`` and ``backward``'s ``seen``)."""
    be, at = part.backend, flat.spans(part)
    h, inputs, seen_in, seen_out, mags = be.asarray(np.ascontiguousarray(x)), [], {}, {}, {}
    for layer in part.layers:
        inputs.append(h)
        if isinstance(layer, Conv2D):
            seen_in[layer.name] = np.array(be.to_numpy(h), np.float32)
        h = layer.forward(h, training=False)
    out = np.asarray(be.to_numpy(h), np.float32)
    d, a = be.asarray(np.asarray(d, np.float32).reshape(out.shape)), np.asarray(a, np.float32).reshape(out.shape)
    for layer, xin in zip(reversed(part.layers), reversed(inputs), strict=True):
        x_host = np.asarray(be.to_numpy(xin), np.float32)
        if isinstance(layer, Conv2D):
            seen_out[layer.name], mags[layer.name] = np.array(be.to_numpy(d), np.float32), a
            if not layer.need_dx:  # the first convolution computes no dX
                break
        if isinstance(layer, BatchNorm2D):
            sums = grads[at[f"{layer.name}.beta"]], grads[at[f"{layer.name}.gamma"]]
            d = be.asarray(_norm_backward(layer, x_host, be.to_numpy(d), *sums, images))
            a = magnitude(layer, x_host, a, sums, images)[0]
        else:
            d, a = layer.backward(d), magnitude(layer, x_host, a)[0]
    return out, seen_in, seen_out, mags


def _norm_backward(
    norm: BatchNorm2D, x: np.ndarray, dy: np.ndarray, dbeta: np.ndarray, dgamma: np.ndarray, images: int
) -> np.ndarray:
    """dx = gamma / std (dy - dbeta / M - xhat dgamma / M) of one image x, dy (1, C, H, W) in a slice of
    ``images``: its mean and std the norm's running statistics (the slice's), M = images H W."""
    shape = (1, -1, 1, 1)
    invstd, xhat = normalised(norm, x)
    m = np.float32(images * x.shape[2] * x.shape[3])
    gamma = norm.backend.to_numpy(norm.params["gamma"]).reshape(shape)
    return (gamma * invstd * (dy - dbeta.reshape(shape) / m - xhat * dgamma.reshape(shape) / m)).astype(np.float32)


def energies(
    part: Network, got: np.ndarray, j: int, seen: tuple[dict, dict, dict], k: int
) -> tuple[list[tuple[str, Pair]], list[tuple[float, float, int, float]]]:
    """Each convolution's e_j the worker sent (``got``: its rows (s, a, e_1, ..., e_n)) against the master's, from
    ``forward_backward``'s output gradients for image j and their magnitudes A, within the module's bound; and the rows
    (the worker's e_j, the master's, k, 2 sum |dY| A) for a sum over checks (``probe.Trails``)."""
    out: list[tuple[str, Pair]] = []
    rows = []
    for c, row in zip(probe.convs(part), got, strict=True):
        dy, a = seen[1][c.name].astype(np.float64), seen[2][c.name]
        mine, n, terms = float(np.square(dy).sum()), k + dy.size + 1, 2 * float((np.abs(dy) * a).sum())
        tol = probe.tolerance(n, terms)
        out.append((f"image {j}'s sum of dY^2 at {c.name}", (row[2 + j : 3 + j], np.array([mine]), tol)))
        rows.append((float(row[2 + j]), mine, n, terms))
    return out, rows


def check(
    first: Message,
    answer: Message,
    reply: Message,
    part: Network,
    j: int,
    extra: int,
    dfeatures: np.ndarray | None = None,
) -> tuple[list[tuple[str, Pair]], list[tuple[float, float, int, float]]]:
    """Image j of the slice forward and backward on the master, through the conv part (``part`` loaded with the
    task's weights and the worker's statistics, ``extra`` the roundings that adds): its logits (or features)
    against the worker's row, each convolution's e_j against the one it sent. The backward starts from its row
    of ``dfeatures``, or from dL/dlogits W of the logits the worker sent (the last bias holds them to its
    gradient): the classifier's forward is off the path, and the round-off of its backward, gamma_(K + FN + 2)
    sum (p + q) / N |W|, is added to the magnitudes it starts from, in units of the bound's lambda sqrt(k) u.
    Returns the parts to judge, and the rows of e_j for a sum over checks (``energies``)."""
    x, got, convs = first.arrays["x"], reply.arrays["probes"], len(probe.convs(part))
    conv = conv_part(part) if first.kind == "replica_step" else part
    n = roundings(conv, x[j : j + 1].shape)[1] + extra + FN  # the forward to the features, the backward
    if dfeatures is None:  # data parallelism: the classifier's (softmax(logits_j) - q_j) / N, through W
        row, fc = answer.arrays["logits"][j : j + 1], part.layers[-1]
        w, b = (np.asarray(part.backend.to_numpy(fc.params[p]), np.float32) for p in ("w", "b"))
        p, q = targets(row, first.arrays["y"][j : j + 1], float(first.header.get("smoothing", 0.0)))
        d = ((p - q) / first.header["batch"]).astype(np.float32) @ w
        rounding = (w.shape[0] + FN + 2) / (probe.LAMBDA * math.sqrt(n))
        a = np.abs(d) + rounding * (((p + q) / first.header["batch"]) @ np.abs(w))
    else:
        row, d = answer.arrays["features"][j : j + 1], dfeatures[j : j + 1]
        a = np.abs(d)
    out, *seen = forward_backward(conv, x[j : j + 1], d, a, reply.arrays["grads"], len(x))
    if dfeatures is None:
        out = out.reshape(1, -1) @ w.T + b
    parts, rows = energies(conv, got.reshape(convs, -1), j, seen, n)
    mine = (
        f"image {j}'s {'logits' if dfeatures is None else 'features'}",
        pair(row, out.reshape(row.shape), roundings(part, x.shape)[0] + extra),
    )
    return [mine, *parts], rows
