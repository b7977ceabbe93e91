"""A spot check's sample (``spot_check.py``): what the master recomputes of a worker's results, and how near
the worker's numbers must be (docs/how-it-works.md, "Spot checks").

An optimisation, the kernel sample's convolution (:func:`few_kernels_forward`, :func:`few_kernels_dw`).
For a few kernels the backend's im2col of the whole batch (C K K x N OH OW floats: 80 MB at 50:500's conv2,
batch 64) costs far more than its GEMM. Contracting the input channels first reads the padded input
X (C, q), q its positions (n, r, c), once: Z[(f, u, v), q] = W[(f, u, v), C] @ X, then y[n, f, oh, ow]
= b[f] + sum_(u, v) Z[(f, u, v), (n, oh s + u, ow s + v)]; and dw[f, C, (u, v)] = X @ D[q, (f, u, v)], D
holding d[n, f, oh, ow] at (n, oh s + u, ow s + v), zero elsewhere. The same products and sums, so the
same k (tests/test_spot_check.py holds them to the plain path); a kernel sample costs a third as much
(11 ms against 33 ms on one core at 50:500's conv2, batch 64).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.conformance.checks import FN, float32_tolerance, scale
from tinyconv.distributed.shard.block import BlockCache, halo_width
from transports.base import Message

Pair = tuple[np.ndarray, np.ndarray, float]  # (the worker's entries, the master's, how far apart they may be)

_COLLECTED = [0.0, 0.0]  # the seconds Python's garbage collector has taken, the start of the collection under way


def clock() -> float:
    """The seconds the checks are charged by: time.perf_counter, less the garbage collector's. A collection that
    happens to run inside a check frees the whole process's garbage, and is not the check's cost: a 15 ms one
    inside a 1 ms image sample at 16:32 would hold that kind's samples back for 40 steps."""
    return time.perf_counter() - _COLLECTED[0]


def _collecting(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _COLLECTED[1] = time.perf_counter()
    else:
        _COLLECTED[0] += time.perf_counter() - _COLLECTED[1]


gc.callbacks.append(_collecting)


def pair(got: np.ndarray, ref: np.ndarray, k: int, top: float = 0.0) -> Pair:
    """``got`` against ``ref`` within round-off of k roundings, on the scale of max|ref|, or of ``top`` where
    larger: a tail's output (ReLU's, of a kernel that rarely fires) can be far smaller than the sums that made it."""
    return got, ref, float(float32_tolerance(min(k, 2**22), max(scale(ref), top)))


def worst(parts: list[tuple[str, Pair]]) -> tuple[tuple[str, Pair], int] | None:
    """The first part with an entry beyond its tolerance (NaN is), and that entry's flat index; None if none."""
    for what, (got, ref, tol) in parts:
        gap = np.abs(got.astype(np.float64) - ref)
        if not (gap <= tol).all():  # most calls: one pass, and NaN is not <= anything
            return (what, (got, ref, tol)), int(np.argmax(np.nan_to_num(gap - tol, nan=np.inf)))
    return None


def sum_pair(got: np.ndarray, terms: np.ndarray, k: int) -> Pair:
    """``got`` (1,) against the sum of ``terms`` (a db entry) in the rigorous form, 2 gamma_k sum|terms|: one sum
    of terms of random signs can cancel far below its terms, and the master has them."""
    tol = float32_tolerance(min(k, 2**22), np.abs(terms).sum(dtype=np.float64))
    return got, terms.sum(dtype=np.float32).reshape(1), float(tol)


def tail_roundings(tail: list[dict[str, Any]], m: int) -> int:
    """The roundings a tail adds to a path, forward or backward: LRN sums ``size`` squares and takes a pow; batch
    norm sums its m = N OH OW values per kernel (the mean, then the variance, or dbeta and dgamma) and scales."""
    return sum(spec["size"] + 2 + FN if spec["op"] == "lrn" else m + 8 if spec["op"] == "bn" else 0 for spec in tail)


def padded(x: np.ndarray, padding: int) -> np.ndarray:
    """x (N, C, H, W) -> X (C, N, H + 2 padding, W + 2 padding): zero-padded, channel-major (the kernel samples')."""
    n, c, h, w = x.shape
    out = np.zeros((c, n, h + 2 * padding, w + 2 * padding), np.float32)
    out[:, :, padding : padding + h, padding : padding + w] = x.transpose(1, 0, 2, 3)
    return out


def few_kernels_forward(xp: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int) -> np.ndarray:
    """An optimisation (the module's docstring): X (C, N, HP, WP) from :func:`padded`, w (F', C, K, K), b (F',)
    -> the convolution (N, F', OH, OW) on the host, as the backend's conv2d_forward, for a few kernels F'."""
    f, c, kh, kw = w.shape
    _, n, hp, wp = xp.shape
    oh, ow = (hp - kh) // stride + 1, (wp - kw) // stride + 1
    z = (w.transpose(0, 2, 3, 1).reshape(-1, c) @ xp.reshape(c, -1)).reshape(f, kh, kw, n, hp, wp)
    y = np.empty((f, n, oh, ow), np.float32)
    y[...] = b[:, None, None, None]
    for u in range(kh):
        for v in range(kw):
            y += z[:, u, v, :, u : u + stride * oh : stride, v : v + stride * ow : stride]
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3))


def few_kernels_dw(xp: np.ndarray, d: np.ndarray, stride: int, kernel: int) -> np.ndarray:
    """An optimisation (the module's docstring): X (C, N, HP, WP) from :func:`padded`, the conv-output gradient
    d (N, F', OH, OW) -> dw (F', C, K, K), as the backend's conv2d_backward, for a few kernels F'."""
    n, f, oh, ow = d.shape
    c, _, hp, wp = xp.shape
    spread = np.zeros((n, hp, wp, f, kernel, kernel), np.float32)
    for u in range(kernel):
        for v in range(kernel):
            spread[:, u : u + stride * oh : stride, v : v + stride * ow : stride, :, u, v] = d.transpose(0, 2, 3, 1)
    dw = xp.reshape(c, -1) @ spread.reshape(-1, f * kernel * kernel)
    return np.ascontiguousarray(dw.reshape(c, f, kernel, kernel).transpose(1, 0, 2, 3))


def fits(reply: Message, shapes: dict[str, tuple[int, ...]], needed: str = "") -> bool:
    """Whether ``reply`` has the arrays ``needed`` and these shapes where it has them (else its split loses it)."""
    if not set(needed.split()) <= reply.arrays.keys():
        return False
    return all(tuple(reply.arrays[name].shape) == s for name, s in shapes.items() if name in reply.arrays)


@dataclass
class Sample:
    """One sample: where, and the master's own forward of it, kept for the backward."""

    kind: str  # "image" or "kernel"
    at: int  # the image n, or the kernel j
    span: slice  # the kernels the master computed for it
    y: np.ndarray | None  # the master's output: y[n] (1, own, OH', OW') or y[:, j] (N, 1, OH', OW'); None: none
    cache: BlockCache | None
    top: float = 0.0  # max|its convolution's output| before the tail: its forward's scale
    xp: np.ndarray | None = None  # a kernel sample's padded input (C, N, HP, WP), for its dw
    partial: np.ndarray | None = None  # split by input channels: P of an image (F, 1, OH, OW) or a kernel (N, OH, OW)
    norm: dict[str, Any] = field(default_factory=dict)  # a batch norm's arrays over the span (task_norm's), and its
    #                                                     batch statistics in training


def kernel_span(j: int, total: int, tail: list[dict[str, Any]]) -> slice:
    """The kernels whose convolution kernel j's tail reads, forward and backward: [j - E, j + E] in [0, total)."""
    e = halo_width(tail)
    return slice(max(0, j - e), min(total, j + e + 1))
