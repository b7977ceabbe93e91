"""The numpy backend's max pool: maxpool_forward_plain written out, and the separable one the backend runs.

maxpool_forward_plain copies every window out as a row and takes its argmax: the definition,
readable. maxpool_forward is its optimised twin with the same contract (tests/test_numpy_strided.py
holds them together): a max over the window's columns, then over its rows.
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


def maxpool_forward_plain(x: np.ndarray, kernel: int, stride: int, padding: int) -> tuple[np.ndarray, tuple]:
    """Max pool written out (maxpool_forward below is the optimised twin; same contract).

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


# A k x k max is done as a max over k columns, then over k rows ("separable"):
# 2k strided passes instead of k*k, and no padded copy of the input. Each stage
# keeps the offset of its first strict maximum, so together they select the
# first maximum in row-major window order, and backward just runs the two
# stages in reverse, routing each gradient through the offset that won.
# A window holding a NaN outputs NaN and selects its last NaN, as torch does: the
# last row whose column max is NaN, and in it the last NaN column -- together the
# last NaN in row-major order.
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
