"""The numpy backend's convolution columns: im2col, its adjoint col2im, and a tiled transpose.

A convolution is one GEMM over columns (numpy_backend.py's docstring). col2im_plain adds a gradient
of them back into the image, tap by tap; col2im is the same sum, bit for bit, faster for the common
stride-1 "same" case (tests/test_numpy_strided.py holds the two together).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from backends.base import conv_output_size


def im2col(x: np.ndarray, kh: int, kw: int, stride: int, padding: int) -> np.ndarray:
    """x (N, C, H, W) -> cols (C*KH*KW, N*OH*OW), one strided copy.

    cols[(c, i, j), (n, oh, ow)] = x_pad[n, c, oh*stride + i, ow*stride + j].
    """
    n, c, h, w = x.shape
    oh = conv_output_size(h, kh, stride, padding)
    ow = conv_output_size(w, kw, stride, padding)
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    sn, sc, sh, sw = x.strides
    view = as_strided(x, (c, kh, kw, n, oh, ow), (sc, sh, sw, sn, sh * stride, sw * stride), writeable=False)
    return view.reshape(c * kh * kw, n * oh * ow)


def transposed(a: np.ndarray, tile: int = 256) -> np.ndarray:
    """a (R, C) -> a.T (C, R) as a new C-contiguous array: the same numbers as np.ascontiguousarray(a.T).

    An optimisation: numpy's transposing copy steps through one of the two arrays a whole row
    at a time, a cache miss per float; tile by tile, both tiles stay in cache (5x faster on a
    (12500, 1500) float32 matrix, the dW of 500:1500's conv2: 25 ms against 134 ms)."""
    r, c = a.shape
    out = np.empty((c, r), a.dtype)
    for i in range(0, r, tile):
        for j in range(0, c, tile):
            out[j : j + tile, i : i + tile] = a[i : i + tile, j : j + tile].T
    return out


def col2im_plain(
    dcols: np.ndarray, x_shape: tuple[int, ...], kh: int, kw: int, stride: int, padding: int
) -> np.ndarray:
    """Adjoint of im2col: dcols (C*KH*KW, N*OH*OW) -> dx (N, C, H, W), overlaps summed.

    Any stride and padding. Each element's terms are added in row-major tap order (i, j),
    starting from +0. col2im is the same sum, faster, for the common stride-1 "same" case.
    """
    n, c, h, w = x_shape
    oh = conv_output_size(h, kh, stride, padding)
    ow = conv_output_size(w, kw, stride, padding)
    d = dcols.reshape(c, kh, kw, n, oh, ow)
    # accumulate in (C, N, Hp, Wp) so each kernel offset is a plain strided add
    dxp = np.zeros((c, n, h + 2 * padding, w + 2 * padding), dtype=dcols.dtype)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += d[:, i, j]
    dxp = dxp[:, :, padding : padding + h, padding : padding + w]
    return np.ascontiguousarray(dxp.transpose(1, 0, 2, 3))


def col2im(
    dcols: np.ndarray,
    x_shape: tuple[int, ...],
    kh: int,
    kw: int,
    stride: int,
    padding: int,
    overwrite_dcols: bool = False,
) -> np.ndarray:
    """col2im_plain's result, bit for bit; an optimisation for stride 1 with OH = H, OW = W.

    Optimisation: col2im_plain's adds run over 4-d views whose rows are OW values long with gaps
    between them, and numpy runs such adds several times slower per value than over contiguous
    memory (conv2 of 48:96 at batch 128: ~75-130 ms, benchmarks/bench_numpy_ops.py). When the
    output has the input's size, a tap (i, j) moves a term by a fixed distance in the flattened
    (N*H*W) map of a channel,

        dx_flat[c, q + (i - padding) * W + (j - padding)] += dcols[(c, i, j), q],   q = (n, oh, ow),

    so each tap is one add of two contiguous (N*H*W)-long rows per channel (~2.5x faster). The
    terms that would land in the padding wrap into a neighbouring row or image instead, so they
    are set to zero first -- in dcols itself when ``overwrite_dcols`` (conv2d_backward's own
    temporary), else in a copy. The taps come in col2im_plain's order and adding +0 changes no
    sum that starts from +0, so the result has the same bits, NaN and inf included.
    """
    n, c, h, w = x_shape
    oh = conv_output_size(h, kh, stride, padding)
    ow = conv_output_size(w, kw, stride, padding)
    if stride != 1 or (oh, ow) != (h, w):
        return col2im_plain(dcols, x_shape, kh, kw, stride, padding)
    if not overwrite_dcols:
        dcols = dcols.copy()
    d = dcols.reshape(c, kh, kw, n, oh, ow)
    for i in range(kh):  # rows of tap i that fall above or below the image
        if i < padding:
            d[:, i, :, :, : padding - i] = 0
        elif i > padding:
            d[:, i, :, :, max(0, oh - (i - padding)) :] = 0
    for j in range(kw):  # columns that fall left or right of it
        if j < padding:
            d[:, :, j, :, :, : padding - j] = 0
        elif j > padding:
            d[:, :, j, :, :, max(0, ow - (j - padding)) :] = 0
    m = n * h * w
    margin = padding * w + padding  # the farthest a tap moves a term
    flat = np.zeros((c, margin + m + margin), dtype=dcols.dtype)
    taps = dcols.reshape(c, kh * kw, m)
    for i in range(kh):
        for j in range(kw):
            start = margin + (i - padding) * w + (j - padding)
            flat[:, start : start + m] += taps[:, i * kw + j]
    dx = flat[:, margin : margin + m].reshape(c, n, h, w)
    return np.ascontiguousarray(dx.transpose(1, 0, 2, 3))
