"""The numpy backend's optimised col2im against col2im_plain, the same sum written out.

``col2im`` takes a faster path for stride 1 with the output the input's size (each tap one add of
contiguous rows, the terms that fall into the padding zeroed first) and adds the taps in
col2im_plain's order, so the two must agree bit for bit -- NaN and inf included -- on odd shapes:
N = 1, C = 1, odd H and W, H != W, kernels larger than the image, even kernels (no "same"
padding: the plain path), stride 2.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.numpy_backend import NumpyBackend, col2im, col2im_plain, conv_output_size, im2col

# (N, C, H, W), kernel, stride, padding
CASES = [
    ((1, 1, 1, 1), 1, 1, 0),
    ((1, 1, 1, 1), 3, 1, 1),
    ((1, 1, 2, 3), 5, 1, 2),  # every tap but the centre reaches past the image
    ((2, 3, 5, 7), 3, 1, 1),
    ((3, 2, 7, 5), 5, 1, 2),
    ((1, 4, 9, 9), 7, 1, 3),
    ((2, 2, 6, 5), 3, 1, 0),  # OH < H: the plain path
    ((2, 2, 6, 5), 2, 1, 1),  # OH > H: the plain path
    ((2, 3, 7, 9), 3, 2, 1),  # stride 2: the plain path
    ((4, 5, 16, 16), 5, 1, 2),  # the networks' conv
]


def _dcols(shape, k, stride, padding, rng) -> np.ndarray:
    n, c, h, w = shape
    oh, ow = conv_output_size(h, k, stride, padding), conv_output_size(w, k, stride, padding)
    d = rng.standard_normal((c * k * k, n * oh * ow)).astype(np.float32)
    d[rng.random(d.shape) < 0.02] = np.nan
    d[rng.random(d.shape) < 0.02] = np.inf
    d[rng.random(d.shape) < 0.02] = -0.0
    return d


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("shape", "k", "stride", "padding"), CASES)
def test_col2im_has_col2im_plains_bits(shape, k, stride, padding):
    d = _dcols(shape, k, stride, padding, np.random.default_rng(sum(shape) + k))
    before = d.copy()
    want = col2im_plain(d, shape, k, k, stride, padding)
    got = col2im(d, shape, k, k, stride, padding)
    assert _same_bits(got, want)
    assert _same_bits(d, before)  # the default leaves dcols alone
    assert _same_bits(col2im(d, shape, k, k, stride, padding, overwrite_dcols=True), want)


@pytest.mark.parametrize(("shape", "k", "stride", "padding"), CASES)
def test_col2im_is_im2cols_adjoint(shape, k, stride, padding):
    """<im2col(x), d> = <x, col2im(d)>: the fast path routes every term to the input that made it."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    d = rng.standard_normal((shape[1] * k * k, im2col(x, k, k, stride, padding).shape[1]))
    lhs = np.sum(im2col(x, k, k, stride, padding) * d)
    rhs = np.sum(x * col2im(d, shape, k, k, stride, padding))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def test_conv2d_backward_dx_matches_the_plain_col2im():
    rng = np.random.default_rng(3)
    be = NumpyBackend()
    x = rng.standard_normal((3, 4, 9, 7)).astype(np.float32)
    w = rng.standard_normal((6, 4, 5, 5)).astype(np.float32)
    y, cache = be.conv2d_forward(x, w, np.zeros(6, np.float32), 1, 2)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, _, _ = be.conv2d_backward(dy, cache)
    dcols = w.reshape(6, -1).T @ dy.transpose(1, 0, 2, 3).reshape(6, -1)
    assert _same_bits(dx, col2im_plain(dcols, x.shape, 5, 5, 1, 2))
