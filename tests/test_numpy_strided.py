"""The numpy backend's optimised col2im, max pool and transpose against the same ops written out.

``col2im`` takes a faster path for stride 1 with the output the input's size (each tap one add of
contiguous rows, the terms that fall into the padding zeroed first) and adds the taps in
col2im_plain's order, so the two must agree bit for bit -- NaN and inf included -- on odd shapes:
N = 1, C = 1, odd H and W, H != W, kernels larger than the image, even kernels (no "same"
padding: the plain path), stride 2.

``transposed`` (the tiled transposing copy behind conv2d_backward's dW) against numpy's own a.T:
the same bits, NaN and inf included, for shapes smaller than, equal to and past a tile's edge.

``conv2d_partial`` (the GEMM's kernel-major output, for the split by input channels) against the
forward's y, bit for bit.

``sgd_update`` (the update run block by block, in cache) against ``sgd_update_plain``: the same
bits for param and velocity, NaN and inf included, on sizes below, at and past a block's edge, with
and without momentum and weight decay, float32 and float64, and a strided grad.

``maxpool_forward`` (a separable max over columns, then rows, keeping each stage's winning offset)
against ``maxpool_forward_plain`` (every window copied out as a row, argmax): the same outputs bit
for bit, and the gradient sent to the same inputs -- checked exactly with integer gradients, whose
sums are exact in any order. With other gradients the two add an input's terms (one per window that
selected it, at most ceil(k/s)^2) in different orders, so they agree to within float32 round-off:
|difference| <= 2 (m - 1) u * (sum of |terms|), m terms, u = 2^-24. It runs block by block of images:
at the default block and at blocks of a few values (an image a block, or a short last block).

``lrn_forward``/``lrn_backward`` run their passes block by block of samples: the same operations on
each value as on the whole map in one block, so the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends import numpy_backend, numpy_maxpool
from backends.base import conv_output_size
from backends.numpy_backend import NumpyBackend, sgd_update, sgd_update_plain
from backends.numpy_columns import col2im, col2im_plain, im2col, transposed
from backends.numpy_maxpool import maxpool_backward_plain, maxpool_forward_plain

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


@pytest.mark.parametrize("size", [1, 7, 8, 9, 24, 100])
@pytest.mark.parametrize(("lr", "momentum", "weight_decay"), [(0.1, 0.9, 5e-4), (0.05, 0.0, 0.0), (1.0, 0.5, 0.0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sgd_update_has_sgd_update_plains_bits(size, lr, momentum, weight_decay, dtype):
    rng = np.random.default_rng(size)
    param = rng.standard_normal((size, 3)).astype(dtype)
    param[0, 0] = np.inf
    velocity = rng.standard_normal((size, 3)).astype(dtype)
    want_p, want_v = param.copy(), velocity.copy()
    got_p, got_v = param.copy(), velocity.copy()
    for step in range(3):  # velocity carries over, as in training
        grad = rng.standard_normal((3, size)).astype(dtype).T  # strided, like a transposed GEMM's
        grad[-1, -1] = np.nan if step == 1 else grad[-1, -1]
        with np.errstate(invalid="ignore"):  # inf - inf, on purpose
            sgd_update_plain(want_p, grad, want_v, lr, momentum, weight_decay)
            sgd_update(got_p, grad, got_v, lr, momentum, weight_decay, block=8)
        assert _same_bits(got_p, want_p) and _same_bits(got_v, want_v)
    before = param.copy()
    NumpyBackend().sgd_update(param, np.ones_like(param), np.zeros_like(param), 0.5, 0.9, 0.0)
    assert np.array_equal(param[1:], before[1:] - 0.5)  # the backend's op is this one, in place


@pytest.mark.parametrize(("shape", "k", "stride", "padding"), CASES)
def test_col2im_is_im2cols_adjoint(shape, k, stride, padding):
    """<im2col(x), d> = <x, col2im(d)>: the fast path routes every term to the input that made it."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    d = rng.standard_normal((shape[1] * k * k, im2col(x, k, k, stride, padding).shape[1]))
    lhs = np.sum(im2col(x, k, k, stride, padding) * d)
    rhs = np.sum(x * col2im(d, shape, k, k, stride, padding))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("shape, tile", [((1, 1), 4), ((3, 5), 4), ((4, 4), 4), ((9, 13), 4), ((300, 7), 256)])
def test_transposed_is_numpys_transpose(shape, tile):
    a = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    a.flat[0], a.flat[-1] = np.nan, -np.inf  # the bits are copied, not computed
    t = transposed(a, tile)
    assert t.flags.c_contiguous and t.shape == shape[::-1]
    np.testing.assert_array_equal(t, a.T)


def test_conv2d_backward_gives_a_contiguous_dw():
    """dW is handed to the optimiser and to the wire: a transposed view would make each of them a
    strided walk (5x slower at 500:1500's conv2)."""
    be, rng = NumpyBackend(), np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y, cache = be.conv2d_forward(x, w, np.zeros(4, np.float32), 1, 1)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    _, dw, _ = be.conv2d_backward(dy, cache, need_dx=False)
    assert dw.flags.c_contiguous
    cols = im2col(x, 3, 3, 1, 1)
    np.testing.assert_array_equal(dw, (cols @ dy.transpose(1, 0, 2, 3).reshape(4, -1).T).T.reshape(w.shape))


def test_conv2d_partial_is_the_forwards_gemm_kernel_major_and_a_subclass_keeps_its_own_convolution():
    """conv2d_partial hands back the GEMM's own (F, N, OH, OW): the forward's y with no bias, bit for
    bit, contiguous (sent and summed uncopied); a subclass that replaces the forward (the threaded
    example) gets P through its forward, not the reference's GEMM."""
    be, rng = NumpyBackend(), np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    y, _ = be.conv2d_forward(x, w, np.zeros(5, np.float32), 2, 1)
    p, cache = be.conv2d_partial(x, w, 2, 1)
    assert p.flags.c_contiguous and p.shape == (5, 2, 4, 3)
    np.testing.assert_array_equal(p, y.transpose(1, 0, 2, 3))
    assert cache[2].shape == (27, 2 * 4 * 3)  # the columns, for conv2d_backward

    class Doubled(NumpyBackend):
        def conv2d_forward(self, x, w, b, stride=1, padding=0):
            y, cache = super().conv2d_forward(x, w, b, stride, padding)
            return 2 * y, cache

    np.testing.assert_array_equal(Doubled().conv2d_partial(x, w, 2, 1)[0], 2 * p)


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


# (N, C, H, W), kernel, stride, padding -- the networks' pools (3/2/1, 2/2/0) and odd ones
POOLS = [
    ((1, 1, 1, 1), 2, 2, 1),
    ((1, 1, 5, 3), 3, 2, 1),
    ((2, 3, 9, 7), 2, 2, 0),
    ((2, 3, 9, 7), 3, 2, 1),
    ((1, 2, 8, 8), 3, 1, 1),
    ((2, 1, 6, 7), 3, 3, 0),
    ((3, 2, 16, 16), 3, 2, 1),
]
VALUES = ["random", "ties", "nan", "-inf"]


def _pool_input(shape, values: str, rng) -> np.ndarray:
    if values == "ties":  # few distinct values: many windows with two or more maxima
        return rng.integers(-2, 3, shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    if values == "nan":
        x[rng.random(shape) < 0.1] = np.nan
    if values == "-inf":  # whole rows of -inf: windows holding nothing else, some reaching the padding
        x[:, :, ::2] = -np.inf
        x[..., :1] = -np.inf
    return x


@pytest.mark.parametrize("block", [numpy_maxpool.BLOCK, 40, 240])
@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize(("shape", "kernel", "stride", "padding"), POOLS)
def test_maxpool_matches_the_plain_one(shape, kernel, stride, padding, values, block, monkeypatch):
    monkeypatch.setattr(numpy_maxpool, "BLOCK", block)
    rng = np.random.default_rng(hash((shape, kernel, stride, padding, values)) % 2**32)
    x = _pool_input(shape, values, rng)
    y, cache = NumpyBackend().maxpool_forward(x, kernel, stride, padding)
    y_plain, cache_plain = maxpool_forward_plain(x, kernel, stride, padding)
    assert _same_bits(y, y_plain)

    # integer gradients: sums exact in any order, so any input routed differently shows
    dy = rng.integers(1, 1000, y.shape).astype(np.float32)
    assert _same_bits(NumpyBackend().maxpool_backward(dy, cache), maxpool_backward_plain(dy, cache_plain))

    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = NumpyBackend().maxpool_backward(dy, cache).astype(np.float64)
    dx_plain = maxpool_backward_plain(dy, cache_plain).astype(np.float64)
    terms = maxpool_backward_plain(np.abs(dy), cache_plain).astype(np.float64)
    m = math.ceil(kernel / stride) ** 2
    assert np.all(np.abs(dx - dx_plain) <= 2 * (m - 1) * 2.0**-24 * terms)


def test_maxpool_plain_selects_as_documented():
    """The plain pool on one window each: first maximum, last NaN, first input inside for -inf alone."""
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]]]], np.float32)
    assert maxpool_forward_plain(x, 2, 2, 0)[1][1].item() == 1  # the first 3, row-major
    x[0, 0, 0, 0] = x[0, 0, 1, 0] = np.nan
    y, (_, sel, *_) = maxpool_forward_plain(x, 2, 2, 0)
    assert np.isnan(y).all() and sel.item() == 2  # the last NaN
    x = np.full((1, 1, 1, 1), -np.inf, np.float32)
    y, (_, sel, *_) = maxpool_forward_plain(x, 3, 2, 1)
    assert y.item() == -np.inf and sel.item() == 4  # the centre: the only input inside the window


@pytest.mark.parametrize(("size", "beta"), [(5, 0.75), (4, 0.6)])
def test_lrn_by_blocks_has_the_bits_of_one_block(size, beta, monkeypatch):
    rng = np.random.default_rng(9)
    x, dy = (rng.standard_normal((5, 7, 3, 4)).astype(np.float32) * 10 for _ in range(2))
    x[0, 0, 0, 0], dy[1, 2, 0, 1] = np.nan, np.inf
    runs = []
    for block in (x.size, 2 * x[0].size, 1):  # one block; two samples a block, the last one short; one each
        monkeypatch.setattr(numpy_backend, "BLOCK", block)
        y, cache = NumpyBackend().lrn_forward(x, size, 1e-2, beta, 2.0)
        with np.errstate(invalid="ignore"):  # inf * 0, on purpose
            runs.append((y, *cache[2:4], NumpyBackend().lrn_backward(dy, cache)))
    for run in runs[1:]:
        assert all(_same_bits(a, b) for a, b in zip(run, runs[0], strict=True))
