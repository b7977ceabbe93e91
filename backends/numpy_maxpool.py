"""The numpy backend's max pool, separable: a k x k max as a max over k columns, then over k rows.

2k strided passes instead of k*k, and no padded copy of the input. Each stage keeps the offset of its
first strict maximum, so together they select the first maximum in row-major window order, and backward
runs the two stages in reverse, routing each gradient through the offset that won. A window holding a
NaN selects its last NaN, as torch does: the last row whose column max is NaN, and in it the last NaN
column. tests/test_numpy_strided.py holds it to the definition written out (tests/numpy_plain.py).
"""

from __future__ import annotations

import numpy as np

from backends.base import conv_output_size


def _pool_taps(size: int, out: int, kernel: int, stride: int, padding: int) -> list[tuple[slice, slice]]:
    """For each window offset t: (outputs it reaches, the inputs they read) as slices.

    Output o reads input o*stride + t - padding; outputs whose input falls in
    the padding are skipped, which is the same as padding with -inf.
    """
    taps = []
    for t in range(kernel):
        lo = max(0, -((t - padding) // stride))
        hi = min(out, (size - 1 - t + padding) // stride + 1)
        if hi > lo:
            first = lo * stride + t - padding
            taps.append((slice(lo, hi), slice(first, first + stride * (hi - lo - 1) + 1, stride)))
        else:
            taps.append((slice(0, 0), slice(0, 0)))
    return taps


def _axis_index(axis: int, s: slice) -> tuple:
    return (slice(None),) * axis + (s,)


def _max_stage(x: np.ndarray, out_shape, taps, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Max over the window offsets along one axis; also which offset won (first on ties).

    The max is NaN exactly where the window holds a NaN (np.maximum propagates it), but the
    offset ignores NaNs: _route_to_last_nan then corrects it where that matters.
    """
    y = np.full(out_shape, -np.inf, dtype=x.dtype)
    # every output starts at the first offset that reaches it, as torch's does, so that a window
    # holding nothing but -inf routes its gradient to its first input, not into the padding
    first = np.zeros(out_shape[axis], dtype=np.int8)
    for t, (out_s, _) in reversed(list(enumerate(taps))):
        first[out_s] = t
    arg = np.empty(out_shape, dtype=np.int8)
    arg[...] = first.reshape([-1 if a == axis else 1 for a in range(len(out_shape))])
    # Optimisation (~20% of the stage, benchmarks/bench_numpy_ops.py --ops maxpool): the comparison
    # and the scaled offsets go into two reused buffers, offset 0 needs no comparison (arg starts at
    # or above it), and offset 1's is the comparison itself, read as int8 (numpy's bools are bytes
    # 0 and 1). Plainly: ``better = v > target; np.maximum(a, better * np.int8(t), out=a)``.
    better = np.empty(out_shape, dtype=bool)
    scaled = np.empty(out_shape, dtype=np.int8)
    for t, (out_s, in_s) in enumerate(taps):
        o = _axis_index(axis, out_s)
        target = y[o]
        v = x[_axis_index(axis, in_s)]
        if t == 0:
            np.maximum(target, v, out=target)
            continue
        # masked copies are slow on mixed masks; arithmetic is not. Offsets come in
        # increasing order, so the winner is the largest t that was strictly better.
        offset = np.greater(v, target, out=better[o]).view(np.int8)
        np.maximum(target, v, out=target)
        if t > 1:
            offset = np.multiply(offset, np.int8(t), out=scaled[o])
        np.maximum(arg[o], offset, out=arg[o])
    return y, arg


def _route_to_last_nan(x: np.ndarray, arg: np.ndarray, taps, axis: int) -> None:
    """Where a window of _max_stage holds a NaN, make ``arg`` the offset of its last NaN (torch's
    rule). Offsets come in increasing order, so each NaN overwrites the ones before it."""
    for t, (out_s, in_s) in enumerate(taps):
        a = arg[_axis_index(axis, out_s)]
        a[np.isnan(x[_axis_index(axis, in_s)])] = t


def _max_stage_backward(dy: np.ndarray, arg: np.ndarray, in_shape, taps, axis: int) -> np.ndarray:
    """Adjoint of _max_stage: each dy goes to the input its winning offset read."""
    dx = np.zeros(in_shape, dtype=dy.dtype)
    for t, (out_s, in_s) in enumerate(taps):
        o = _axis_index(axis, out_s)
        dx[_axis_index(axis, in_s)] += dy[o] * (arg[o] == t)
    return dx


def maxpool_forward(x: np.ndarray, kernel: int, stride: int, padding: int) -> tuple[np.ndarray, tuple]:
    """x (N, C, H, W) -> (y (N, C, OH, OW), the cache maxpool_backward takes): the numpy backend's max pool."""
    n, c, h, w = x.shape
    oh = conv_output_size(h, kernel, stride, padding)
    ow = conv_output_size(w, kernel, stride, padding)
    cols = _pool_taps(w, ow, kernel, stride, padding)
    rows = _pool_taps(h, oh, kernel, stride, padding)
    r, rarg = _max_stage(x, (n, c, h, ow), cols, axis=3)
    y, yarg = _max_stage(r, (n, c, oh, ow), rows, axis=2)
    # Optimisation: a NaN-aware comparison in every stage makes the forward ~25% slower
    # (benchmarks/bench_numpy_ops.py), and NaNs are rare, so the stages compare with `>`
    # alone and one pass over the smallest array says whether any window held a NaN: y is
    # NaN exactly where one did. Rows of r that y does not read get no gradient, so their
    # offsets need no correction.
    if np.isnan(y).any():
        _route_to_last_nan(x, rarg, cols, axis=3)
        _route_to_last_nan(r, yarg, rows, axis=2)
    return y, ((n, c, h, w), rarg, yarg, cols, rows)


def maxpool_backward(dy: np.ndarray, cache: tuple) -> np.ndarray:
    """dy (N, C, OH, OW) -> dx (N, C, H, W): each gradient to the input its window selected, overlaps summed."""
    (n, c, h, w), rarg, yarg, cols, rows = cache
    dr = _max_stage_backward(dy, yarg, (n, c, h, dy.shape[3]), rows, axis=2)
    return _max_stage_backward(dr, rarg, (n, c, h, w), cols, axis=3)
