"""A conv block on a slice of kernels: the convolution plus the per-channel layers after it, "the tail".

ReLU, max pool and batch norm work channel by channel, LRN on a window of neighbours, so a participant that
owns kernels [s, e) runs conv -> tail for its channels if it also computes a few neighbouring kernels, the
*halo* (docs/how-it-works.md, "The tail rides along"). For one cross-channel layer whose output i reads inputs
[i - before, i + after] (LRN: before = size // 2, after = (size - 1) // 2)::

    forward   output [lo, hi) needs input  [lo - before, hi + after)
    backward  input gradient [s, e) needs the output gradient and the saved outputs on
              [s - after, e + before)   (dx_j sums over the outputs i whose window holds j)

With E = sum over the tail of (before + after), a participant owning [s, e) computes the convolution for
kernels [s - E, e + E), clipped to [0, F) (:func:`halo_span`), and runs the tail over all of them. Each layer's
output is exact wherever its window stayed inside the computed range or hit the true edge 0 or F; that range
shrinks by (before, after) per layer and stays a superset of what backward reads, so the tail's output and
gradient for [s, e) are exact. The conv gradient outside [s, e) is zeroed -- the halo kernels' gradients are
their owners' to give -- and the conv backward gives dW and db rows for [s, e) and this participant's partial
dX. A batch norm normalises a participant's kernels by their own batch statistics (``norm.py``).

A tail is a list of specs, the form they travel in over the wire (an empty tail: the paper's bare convolution)::

    {"op": "relu"}
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0}
    {"op": "bn", "eps": 1e-5, "training": true}
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import Array, Backend, conv_output_size
from tinyconv.layers import Fused


def halo_width(tail: list[dict[str, Any]]) -> int:
    """E: the kernels computed beyond each end of a slice, the sum of the windows' reach."""
    return sum(spec["size"] - 1 for spec in tail if spec["op"] == "lrn")  # before + after = size - 1


def halo_span(s: int, e: int, total: int, tail: list[dict[str, Any]]) -> slice:
    """The kernels a participant owning [s, e) of ``total`` computes: [s - E, e + E) in [0, total)."""
    if s == e:
        return slice(s, s)
    width = halo_width(tail)
    return slice(max(0, s - width), min(total, e + width))


def tail_output_hw(h: int, w: int, tail: list[dict[str, Any]]) -> tuple[int, int]:
    """(H, W) of the tail's output for an (H, W) input (raises ValueError if a pool does not fit)."""
    for spec in tail:
        if spec["op"] == "maxpool":
            h = conv_output_size(h, spec["kernel"], spec["stride"], spec["padding"])
            w = conv_output_size(w, spec["kernel"], spec["stride"], spec["padding"])
    return h, w


@dataclass
class BlockCache:
    conv: Any  # the backend's conv cache, for all computed kernels
    specs: list[dict[str, Any]]  # the tail
    tail: list[Any]  # each tail layer's backend cache
    own: tuple[int, int]  # the owned kernels, as offsets into the computed ones
    out_shape: tuple[int, ...]  # the tail's output over all computed kernels
    dnorm: dict[str, Array] = field(default_factory=dict)  # backward, batch norm's dgamma, dbeta of the owned kernels


def block_forward(
    be: Backend,
    x: Array,
    w: Array,
    b: Array,
    stride: int,
    padding: int,
    tail: list[dict[str, Any]],
    own: tuple[int, int] | None = None,
    norm: dict | None = None,
) -> tuple[Array, BlockCache]:
    """x (N, C, H, W), w (F', C, K, K), b (F',) -> y (N, hi - lo, OH, OW), the tail's output for kernels ``own``
    = [lo, hi) of F' (default all: a backend array; else a host array), and the cache for :func:`block_backward`.
    ``norm``: as :func:`tail_forward` takes it."""
    y, conv_cache = be.conv2d_forward(x, w, b, stride, padding)
    return tail_forward(be, y, conv_cache, tail, own if own is not None else (0, w.shape[0]), norm)


def tail_forward(
    be: Backend, y: Array, conv_cache: Any, tail: list[dict[str, Any]], own: tuple[int, int], norm: dict | None = None
) -> tuple[Array, BlockCache]:
    """The tail over a conv output y (N, computed, OH, OW) -> its output for kernels ``own`` = [lo, hi).

    ``conv_cache``, kept for the backward: the backend's cache of the convolution that made y (split
    by input channels, ``by_channels.py``: of this participant's partial, and y the sum of all).
    ``norm``, a batch norm's: gamma, beta (outside training running_mean, running_var) of each computed
    kernel; in training its batch mean and unbiased variance are put in as mean and var."""
    computed = y.shape[1]
    lo, hi = own
    if not 0 <= lo < hi <= computed:
        raise ValueError(f"own kernels [{lo}, {hi}) are not a non-empty range of the {computed} computed")
    caches: list[Any] = []
    for i, spec in enumerate(tail):
        # An optimisation, as Network.forward does: a ReLU directly followed by an LRN runs as one
        # backend op (Backend.relu_lrn_forward; a device fuses it), recorded as Fused caches.
        if spec["op"] == "relu" and i + 1 < len(tail) and tail[i + 1]["op"] == "lrn":
            caches.append(Fused())  # the LRN's op below does this ReLU too
            continue
        if spec["op"] == "relu":
            y, c = be.relu_forward(y)
        elif spec["op"] == "lrn" and caches and isinstance(caches[-1], Fused):
            y, c = be.relu_lrn_forward(y, spec["size"], spec["alpha"], spec["beta"], spec["k"])
            c = Fused(c)
        elif spec["op"] == "lrn":
            y, c = be.lrn_forward(y, spec["size"], spec["alpha"], spec["beta"], spec["k"])
        elif spec["op"] == "bn":
            if spec["training"]:  # with momentum 1 the running statistics the backend updates are the batch's
                norm["mean"], norm["var"] = be.zeros((computed,)), be.zeros((computed,))
            stats = [norm[k] for k in (("mean", "var") if spec["training"] else ("running_mean", "running_var"))]
            y, c = be.batchnorm_forward(y, norm["gamma"], norm["beta"], *stats, spec["training"], 1.0, spec["eps"])
        else:
            y, c = be.maxpool_forward(y, spec["kernel"], spec["stride"], spec["padding"])
        caches.append(c)
    cache = BlockCache(conv_cache, tail, caches, (lo, hi), tuple(y.shape))
    if (lo, hi) != (0, computed):
        y = be.to_numpy(y)[:, lo:hi]
    return y, cache


def block_backward(be: Backend, dy: Array, cache: BlockCache, need_dx: bool) -> tuple[Array | None, Array, Array]:
    """dy (N, computed, OH, OW), the tail-output gradient of every kernel the forward computed ->
    (partial dx (N, C, H, W) or None, dw (hi - lo, C, K, K), db (hi - lo,)) of the owned kernels [lo, hi)."""
    return conv_backward(be, tail_backward(be, dy, cache), cache, need_dx)


def conv_backward(be: Backend, d: Array, cache: BlockCache, need_dx: bool) -> tuple[Array | None, Array, Array]:
    """The convolution's backward from d (N, computed, OH, OW), the conv-output gradient :func:`tail_backward` gives:
    (partial dx or None, dw, db) of the owned kernels, as :func:`block_backward` returns them."""
    lo, hi = cache.own
    dx, dw, db = be.conv2d_backward(d, cache.conv, need_dx)
    if (lo, hi) != (0, cache.out_shape[1]):
        dw, db = be.take_kernels(dw, lo, hi), be.take_kernels(db, lo, hi)
    return dx, dw, db


def tail_backward(be: Backend, dy: Array, cache: BlockCache) -> Array:
    """The tail's backward: the conv-output gradient (N, computed, OH, OW), zero outside the owned kernels."""
    if tuple(dy.shape) != cache.out_shape:
        raise ValueError(
            f"dy {tuple(dy.shape)} does not fit the forward: it needs the shape of its output over "
            f"every computed kernel, {cache.out_shape}"
        )
    d = dy
    for spec, c in zip(reversed(cache.specs), reversed(cache.tail), strict=True):
        if isinstance(c, Fused) and spec["op"] == "relu":
            pass  # the fused LRN, whose backward ran just before this, went through this ReLU too
        elif isinstance(c, Fused):
            d = be.relu_lrn_backward(d, c.cache)
        elif spec["op"] == "relu":
            d = be.relu_backward(d, c)
        elif spec["op"] == "lrn":
            d = be.lrn_backward(d, c)
        elif spec["op"] == "bn":
            d, dgamma, dbeta = be.batchnorm_backward(d, c)
            cache.dnorm = {"gamma": dgamma, "beta": dbeta}
        else:
            d = be.maxpool_backward(d, c)
    lo, hi = cache.own
    if (lo, hi) != (0, cache.out_shape[1]):  # the halo kernels' gradient is not this participant's to give
        cache.dnorm = {k: be.take_kernels(v, lo, hi) for k, v in cache.dnorm.items()}
        host = be.to_numpy(d)
        if d is dy:  # an empty tail passed dy through: not ours to overwrite
            host = host.copy()
        host[:, :lo] = 0
        host[:, hi:] = 0
        d = be.asarray(host)
    return d
