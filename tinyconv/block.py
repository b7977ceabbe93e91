"""A conv block on a slice of kernels: the convolution plus the per-channel layers after it.

The paper sends workers only the convolution and runs every other layer on the
master. But the layers after a convolution -- ReLU, max pool, LRN -- work channel
by channel (LRN on a window of neighbouring channels), so they split by kernels
just as the convolution does. A participant that owns kernels [s, e) can run
conv -> ReLU -> LRN -> pool ("the tail") for exactly its channels if it also
computes a few neighbouring kernels, the *halo*; then the master keeps no
per-channel work and the maps that come back are the pooled ones, 4x smaller.

The halo, for one cross-channel layer whose output i reads inputs
[i - before, i + after] (LRN: before = size // 2, after = (size - 1) // 2):

    forward   output [lo, hi) needs input  [lo - before, hi + after)
    backward  dx_j = ... sum over i with j in window(i), i.e. i in [j - after, j + before]:
              input gradient [s, e) needs the output gradient and the saved
              outputs on [s - after, e + before)

With E = sum over the tail of (before + after), a participant owning [s, e):

1. computes the convolution for kernels [s - E, e + E), clipped to [0, F);
2. runs the tail over all of them. Each layer's output is exact wherever its
   window stayed inside the computed range or hit the true edge 0 or F; that
   range shrinks by (before, after) per layer and stays a superset of what
   backward reads, [s - A, e + B) with A = sum(after), B = sum(before);
3. returns the tail output for [s, e), which is exact.

Backward receives the gradient of the tail output on [s - A, e + B), pads it with
zeros to the computed range, runs the tail backward (the gradient it gives for
[s, e) is exact: it reads only given values), zeroes the conv gradient outside
[s, e) and runs the conv backward: dW and db rows for [s, e) and this
participant's partial dX = W[s:e]^T-convolution of dY[s:e]. The halo costs 2E
extra kernels in the forward convolution and in dW (8 of 500 for LRN size 5).

A tail is a list of specs, the form they travel in over the wire::

    {"op": "relu"}
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0}
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1}

With an empty tail a block is just the convolution of the paper's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array, Backend, conv_output_size
from tinyconv.layers import LocalResponseNorm, MaxPool2D, ReLU

TAIL_OPS = {  # op -> its parameters and their types
    "relu": {},
    "lrn": {"size": int, "alpha": float, "beta": float, "k": float},
    "maxpool": {"kernel": int, "stride": int, "padding": int},
}


def tail_of(layers: list[Any]) -> list[dict[str, Any]]:
    """Specs for the leading run of ReLU / LocalResponseNorm / MaxPool2D in ``layers``."""
    tail: list[dict[str, Any]] = []
    for layer in layers:
        if isinstance(layer, ReLU):
            tail.append({"op": "relu"})
        elif isinstance(layer, LocalResponseNorm):
            tail.append(
                {
                    "op": "lrn",
                    "size": layer.size,
                    "alpha": float(layer.alpha),
                    "beta": float(layer.beta),
                    "k": float(layer.k),
                }
            )
        elif isinstance(layer, MaxPool2D):
            tail.append({"op": "maxpool", "kernel": layer.kernel, "stride": layer.stride, "padding": layer.padding})
        else:
            break
    return tail


def check_tail(tail: Any) -> list[dict[str, Any]]:
    """Raise ValueError unless ``tail`` is a list of valid specs; returns it."""
    if not isinstance(tail, list):
        raise ValueError(f"tail must be a list of layer specs, got {type(tail).__name__}")
    for i, spec in enumerate(tail):
        if not isinstance(spec, dict) or spec.get("op") not in TAIL_OPS:
            raise ValueError(f"tail[{i}] must be a map with op one of {sorted(TAIL_OPS)}, got {spec!r:.200}")
        params = TAIL_OPS[spec["op"]]
        if set(spec) != {"op", *params}:
            raise ValueError(f"tail[{i}] ({spec['op']}) needs exactly the keys {sorted(params)}, got {sorted(spec)}")
        for key, kind in params.items():
            v = spec[key]
            ok = isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, (int, float))
            if not ok or isinstance(v, bool):
                raise ValueError(f"tail[{i}].{key} must be a{'n int' if kind is int else ' number'}, got {v!r}")
        if spec["op"] == "lrn" and not (1 <= spec["size"] <= 64 and spec["k"] > 0 and spec["beta"] >= 0):
            raise ValueError(f"tail[{i}]: lrn needs 1 <= size <= 64, k > 0, beta >= 0, got {spec}")
        if spec["op"] == "maxpool" and not (
            spec["kernel"] >= 1 and spec["stride"] >= 1 and 0 <= spec["padding"] < spec["kernel"]
        ):
            raise ValueError(f"tail[{i}]: maxpool needs kernel >= 1, stride >= 1, 0 <= padding < kernel, got {spec}")
    return tail


def _window(spec: dict[str, Any]) -> tuple[int, int]:
    """(before, after): how many neighbouring channels one output channel reads on each side."""
    if spec["op"] == "lrn":
        return spec["size"] // 2, (spec["size"] - 1) // 2
    return 0, 0


def halo(tail: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(E, A, B): kernels computed beyond each end of a slice, and the output-gradient
    channels backward needs before (A) and after (B) it."""
    windows = [_window(spec) for spec in tail]
    return sum(b + a for b, a in windows), sum(a for _, a in windows), sum(b for b, _ in windows)


def tail_output_hw(h: int, w: int, tail: list[dict[str, Any]]) -> tuple[int, int]:
    """(H, W) of the tail's output for an (H, W) input (raises ValueError if a pool does not fit)."""
    for spec in tail:
        if spec["op"] == "maxpool":
            h = conv_output_size(h, spec["kernel"], spec["stride"], spec["padding"])
            w = conv_output_size(w, spec["kernel"], spec["stride"], spec["padding"])
    return h, w


def extended(s: int, e: int, total: int, tail: list[dict[str, Any]]) -> tuple[int, int]:
    """The kernels a participant owning [s, e) of ``total`` computes forward: [s - E, e + E) in [0, total)."""
    ext, _, _ = halo(tail)
    return max(0, s - ext), min(total, e + ext)


def grad_span(s: int, e: int, total: int, tail: list[dict[str, Any]]) -> tuple[int, int]:
    """The tail-output gradient channels backward of [s, e) needs: [s - A, e + B) in [0, total)."""
    _, before, after = halo(tail)
    return max(0, s - before), min(total, e + after)


@dataclass
class BlockCache:
    conv: Any  # the backend's conv cache, for all computed kernels
    specs: list[dict[str, Any]]  # the tail
    tail: list[Any]  # each tail layer's backend cache
    own: tuple[int, int]  # the owned kernels, as offsets into the computed ones
    computed: int  # how many kernels were computed (own plus halo)
    out_shape: tuple[int, ...]  # the tail's output over all computed kernels


def block_forward(
    be: Backend,
    x: Array,
    w: Array,
    b: Array,
    stride: int,
    padding: int,
    tail: list[dict[str, Any]],
    own: tuple[int, int] | None = None,
) -> tuple[Array, BlockCache]:
    """x (N, C, H, W), w (F', C, K, K), b (F',) -> the tail's output for kernels ``own`` = [lo, hi) of F'.

    Returns y (N, hi - lo, OH, OW) -- a backend array, the whole output when ``own``
    is all F' kernels, else a host array -- and the cache for :func:`block_backward`.
    """
    y, conv_cache = be.conv2d_forward(x, w, b, stride, padding)
    return tail_forward(be, y, conv_cache, tail, own if own is not None else (0, w.shape[0]))


def tail_forward(
    be: Backend, y: Array, conv_cache: Any, tail: list[dict[str, Any]], own: tuple[int, int]
) -> tuple[Array, BlockCache]:
    """The tail over a conv output y (N, computed, OH, OW) -> its output for kernels ``own`` = [lo, hi).

    ``conv_cache`` is kept for the backward: the backend's cache of the convolution that made y
    (for a layer split by input channels, ShardedConv's ``split="channels"``, the cache of this
    participant's partial convolution, and y the sum of every participant's partial)."""
    computed = y.shape[1]
    lo, hi = own
    if not 0 <= lo < hi <= computed:
        raise ValueError(f"own kernels [{lo}, {hi}) are not a non-empty range of the {computed} computed")
    caches = []
    for spec in tail:
        if spec["op"] == "relu":
            y, c = be.relu_forward(y)
        elif spec["op"] == "lrn":
            y, c = be.lrn_forward(y, spec["size"], spec["alpha"], spec["beta"], spec["k"])
        else:
            y, c = be.maxpool_forward(y, spec["kernel"], spec["stride"], spec["padding"])
        caches.append(c)
    cache = BlockCache(conv_cache, tail, caches, (lo, hi), computed, tuple(y.shape))
    if (lo, hi) != (0, computed):
        y = be.to_numpy(y)[:, lo:hi]
    return y, cache


def block_backward(
    be: Backend, dy: Array, cache: BlockCache, dy_from: int = 0, need_dx: bool = True
) -> tuple[Array | None, Array, Array]:
    """dy: the tail-output gradient for computed kernels [dy_from, dy_from + dy.shape[1]), which must
    cover :func:`grad_span` of the owned ones. Returns (partial dx (N, C, H, W) or None,
    dw (hi - lo, C, K, K), db (hi - lo,)) for the owned kernels [lo, hi).

    For a layer split by input channels (ShardedConv's ``split="channels"``) only the first half,
    :func:`tail_backward`, runs here: the conv-output gradients of every participant's kernels
    are then gathered, and each runs the conv's backward through its partial convolution."""
    return conv_backward(be, tail_backward(be, dy, cache, dy_from), cache, need_dx)


def tail_backward(be: Backend, dy: Array, cache: BlockCache, dy_from: int = 0) -> Array:
    """The tail's backward: the conv-output gradient (N, computed, OH, OW), zero outside the owned kernels."""
    lo, hi = cache.own
    n, computed, oh, ow = cache.out_shape
    _, before, after = halo(cache.specs)
    need = (max(0, lo - before), min(computed, hi + after))
    if not (
        len(dy.shape) == 4
        and (dy.shape[0], *dy.shape[2:]) == (n, oh, ow)
        and 0 <= dy_from <= need[0]
        and need[1] <= dy_from + dy.shape[1] <= computed
    ):
        raise ValueError(
            f"dy {tuple(dy.shape)} from channel {dy_from} does not fit the forward: it needs shape "
            f"(N={n}, C, {oh}, {ow}) covering computed channels [{need[0]}, {need[1]}) of {computed}"
        )
    if dy.shape[1] == computed:
        d = dy
    else:  # zeros where no gradient was sent: it reaches only the halo, which is discarded
        full = np.zeros(cache.out_shape, np.float32)
        full[:, dy_from : dy_from + dy.shape[1]] = be.to_numpy(dy)
        d = be.asarray(full)
    for spec, c in zip(reversed(cache.specs), reversed(cache.tail), strict=True):
        if spec["op"] == "relu":
            d = be.relu_backward(d, c)
        elif spec["op"] == "lrn":
            d = be.lrn_backward(d, c)
        else:
            d = be.maxpool_backward(d, c)
    if (lo, hi) != (0, computed):  # the halo kernels' gradient is not this participant's to give
        host = be.to_numpy(d)
        if d is dy:  # not ours to overwrite
            host = host.copy()
        host[:, :lo] = 0
        host[:, hi:] = 0
        d = be.asarray(host)
    return d


def owned(be: Backend, d: Array, cache: BlockCache) -> np.ndarray:
    """The owned kernels' channels [lo, hi) of a conv-output gradient from :func:`tail_backward` (host)."""
    lo, hi = cache.own
    return be.to_numpy(d)[:, lo:hi]


def conv_backward(be: Backend, d: Array, cache: BlockCache, need_dx: bool = True) -> tuple[Array | None, Array, Array]:
    """The convolution's backward from :func:`tail_backward`'s gradient: (partial dx or None, dw, db)
    with dw, db the owned kernels' rows."""
    lo, hi = cache.own
    dx, dw, db = be.conv2d_backward(d, cache.conv, need_dx)
    if (lo, hi) != (0, cache.computed):
        dw, db = be.take_kernels(dw, lo, hi), be.take_kernels(db, lo, hi)
    return dx, dw, db
