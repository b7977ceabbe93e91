"""The numpy backend's max pool: maxpool_forward_plain written out, and the separable one the backend runs.

maxpool_forward_plain copies every window out as a row and takes its argmax: the definition,
readable. maxpool_forward is its optimised twin with the same contract (tests/test_numpy_strided.py
holds them together): a max over the window's columns, then over its rows, each over contiguous copies
of the input split by phase, block by block of images.
"""

from __future__ import annotations

import numpy as np

from backends.base import conv_output_size

BLOCK = 1 << 16  # elements per block of a pass run block by block: a few such blocks fit in L2


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


# An optimisation of the plain pool: a k x k max is a max over k columns, then over k rows ("separable"),
# each on contiguous memory. numpy runs np.maximum over a stride-2 view ~5x slower than over contiguous rows,
# while a strided *copy* is cheap; so the input is copied, split by phase, into planes padded with -inf:
# along an axis, plane r holds the inputs i = stride*j + r - padding at its positions j = 0..q-1 (_phases),
# and window offset t of every window is then one contiguous slice, plane t % stride from position
# t // stride on (_max_taps). The columns' planes are split by the rows' phases in turn, so that the column
# maxima come out as the rows' planes, and all of it runs block by block of images, in cache: 3-4.5x
# forward, 2-2.8x backward against the separable pool on strided views before it (50:500's maps, batch 64
# and 256, bench_numpy_ops.py --arch 50:500 --ops maxpool). Each stage keeps the offset of its first strict
# maximum, so together they select the first maximum in row-major window order; a window holding a NaN
# selects its last NaN (the last row whose column max is NaN, and in it the last NaN column), one holding
# -inf alone its first input inside the image, as the plain pool does. Positions past ``out`` are scratch.
# The backward runs the adjoints of the two stages in reverse.
def _phases(size: int, out: int, kernel: int, stride: int, padding: int) -> tuple[int, list[tuple[slice, slice]]]:
    """Along an axis of ``size`` inputs: q = out + (kernel - 1) // stride positions a plane, and for each
    plane r, (positions, inputs): the positions that hold inputs and those inputs, as slices."""
    q, planes = out + (kernel - 1) // stride, []
    for r in range(stride):
        lo = max(0, -((r - padding) // stride))
        hi = max(lo, min(q, (size - 1 - r + padding) // stride + 1))
        first = stride * lo + r - padding
        planes.append((slice(lo, hi), slice(first, first + stride * (hi - lo - 1) + 1, stride)))
    return q, planes


def _max_taps(flat, length, shift, kernel, stride, y, arg, better, scaled) -> None:
    """One stage: flat (1-D) holds ``stride`` planes ``length`` apart, and offset t of the windows is
    tap_t = flat[(t % stride) * length + (t // stride) * shift:][:n]; y (n,) = max_t tap_t, and arg (n,) int8
    the offset that won: the last strictly greater than all before it, i.e. the first maximum (not the last
    NaN: _redo). better, scaled: scratch (n,) bool and int8."""

    def tap(t: int) -> np.ndarray:
        return flat[(t % stride) * length + (t // stride) * shift :][: len(y)]

    if kernel == 1:
        np.copyto(y, tap(0))
        arg[:] = 0
    for t in range(1, kernel):
        if t == 1:  # offset 1 against offset 0: numpy's bools are the bytes 0 and 1
            np.greater(tap(1), tap(0), out=arg.view(bool))
            np.maximum(tap(0), tap(1), out=y)
            continue
        offset = np.greater(tap(t), y, out=better).view(np.int8)
        np.maximum(y, tap(t), out=y)
        np.maximum(arg, np.multiply(offset, np.int8(t), out=scaled), out=arg)


def _max_taps_adjoint(dy, arg, flat, length, shift, kernel, stride, chosen, term) -> None:
    """The adjoint of _max_taps: dy (n,) -> flat's planes, d tap_t[i] = dy[i] * [arg[i] == t] summed where
    taps overlap. Offsets in increasing order: those below ``stride`` write their plane, the others add (a
    shifted plane's first positions take nothing: what would reach them comes from scratch outputs)."""
    n = len(dy)
    for t in range(kernel):
        at, sh = (t % stride) * length, (t // stride) * shift
        won = np.equal(arg[: n - sh], t, out=chosen[: n - sh])
        if sh == 0:
            np.multiply(dy, won, out=flat[at : at + n])
        else:
            flat[at + sh : at + n] += np.multiply(dy[: n - sh], won, out=term[: n - sh])


def _redo(flat, length, shift, kernel, stride, padding, arg, axis, shape) -> None:
    """The windows _max_taps gets wrong, rare enough to be redone only where a block's y holds a NaN or -inf:
    one holding a NaN selects its last NaN, one starting in the padding at least its first input inside (a
    window of -inf alone). ``axis`` of arg viewed as ``shape`` is the one the windows run along."""
    for t in range(kernel):  # in increasing order: each NaN overwrites the ones before
        arg[np.isnan(flat[(t % stride) * length + (t // stride) * shift :][: len(arg)])] = t
    arg = arg.reshape(shape)
    for j in range(min(shape[axis], -(-padding // stride))):
        at = (slice(None),) * (axis % len(shape)) + (j,)
        np.maximum(arg[at], padding - stride * j, out=arg[at])


def _geometry(n, c, h, w, kernel, stride, padding):
    """OH, OW, each axis' planes (_phases), the images a block holds and the blocks' first images."""
    oh, ow = conv_output_size(h, kernel, stride, padding), conv_output_size(w, kernel, stride, padding)
    (qh, rows), (qw, cols) = _phases(h, oh, kernel, stride, padding), _phases(w, ow, kernel, stride, padding)
    ib = max(1, min(n * c, BLOCK // (stride * qh * qw)))  # images a block holds
    return oh, ow, qh, qw, rows, cols, ib, range(0, n * c, ib)


def maxpool_forward(x: np.ndarray, kernel: int, stride: int, padding: int) -> tuple[np.ndarray, tuple]:
    """x (N, C, H, W) -> (y (N, C, OH, OW), the cache maxpool_backward takes): the numpy backend's max pool."""
    n, c, h, w = x.shape
    oh, ow, qh, qw, rows, cols, ib, blocks = _geometry(n, c, h, w, kernel, stride, padding)
    e, size = (kernel - 1) // stride, ib * qh * qw  # size: a row plane of a block, (ib, QH, QW)
    planes = np.full((stride, stride * size + e), -np.inf, x.dtype)  # column plane rw: its row planes rh
    r = np.full(stride * size + e * qw, -np.inf, x.dtype)  # the column maxima: the row planes
    y2, yarg = np.empty(size, x.dtype), np.empty((len(blocks), size), np.int8)
    rarg = np.empty((len(blocks), stride * size), np.int8)
    better, scaled = np.empty(stride * size, bool), np.empty(stride * size, np.int8)
    images, y = x.reshape(n * c, h, w), np.empty((n * c, oh, ow), x.dtype)
    for b, i in enumerate(blocks):
        xb = images[i : i + ib]
        for rw, (pw, iw) in enumerate(cols):
            plane = planes[rw, : stride * size].reshape(stride, ib, qh, qw)
            for rh, (ph, ih) in enumerate(rows):
                plane[rh, : len(xb), ph, pw] = xb[:, ih, iw]
        _max_taps(planes.reshape(-1), stride * size + e, 1, kernel, stride, r[: stride * size], rarg[b], better, scaled)
        _max_taps(r, size, qw, kernel, stride, y2, yarg[b], better[:size], scaled[:size])
        y[i : i + ib] = y2.reshape(ib, qh, qw)[: len(xb), :oh, :ow]
        if not y[i : i + ib].min() > -np.inf:  # a NaN or -inf: some windows to redo
            _redo(planes.reshape(-1), stride * size + e, 1, kernel, stride, padding, rarg[b], -1, (-1, qw))
            _redo(r, size, qw, kernel, stride, padding, yarg[b], -2, (ib, qh, qw))
    return y.reshape(n, c, oh, ow), ((n, c, h, w), rarg, yarg, kernel, stride, padding)


def maxpool_backward(dy: np.ndarray, cache: tuple) -> np.ndarray:
    """dy (N, C, OH, OW) -> dx (N, C, H, W): dx[i, j] = sum of dy[o, p] over the windows (o, p) that selected
    input (i, j) -- the adjoints of the rows' stage, then the columns'."""
    (n, c, h, w), rarg, yarg, kernel, stride, padding = cache
    oh, ow, qh, qw, rows, cols, ib, blocks = _geometry(n, c, h, w, kernel, stride, padding)
    size = ib * qh * qw
    d2, dr = np.zeros((ib, qh, qw), dy.dtype), np.zeros(stride * size, dy.dtype)
    planes = np.zeros((stride, stride * size), dy.dtype)
    chosen, term = np.empty(stride * size, bool), np.empty(stride * size, dy.dtype)
    dys, dx = dy.reshape(n * c, oh, ow), np.empty((n * c, h, w), dy.dtype)
    for b, i in enumerate(blocks):
        m = len(dys[i : i + ib])
        d2[:m, :oh, :ow], d2[m:] = dys[i : i + ib], 0  # scratch positions stay zero
        _max_taps_adjoint(d2.reshape(-1), yarg[b], dr, size, qw, kernel, stride, chosen, term)
        _max_taps_adjoint(dr, rarg[b], planes.reshape(-1), stride * size, 1, kernel, stride, chosen, term)
        for rw, (pw, iw) in enumerate(cols):
            plane = planes[rw].reshape(stride, ib, qh, qw)
            for rh, (ph, ih) in enumerate(rows):
                dx[i : i + m, ih, iw] = plane[rh, :m, ph, pw]
    dx[:, max(0, stride * qh - padding) :], dx[:, :, max(0, stride * qw - padding) :] = 0, 0  # inputs no window reads
    return dx.reshape(n, c, h, w)
