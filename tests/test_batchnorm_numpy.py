"""The numpy backend's optimised batch norm against the same math written out and against float64.

``NumpyBackend.batchnorm_forward``/``_backward`` sum each channel's rows of H*W values by BLAS
(``_channel_sum``, ``_centred_dot``) and run their passes block by block of samples or channels
(``_blocks``), at the default block size and at a tiny one, so that blocks of many samples, of some
channels and a short last one all occur; ``batchnorm_forward_plain`` and ``batchnorm_backward_plain``
are the math as BatchNorm2D's docstring writes it. A float32 sum of terms in which each term meets at
most d roundings has |error| <= d * u * sum |terms| (u = 2^-24, first order), in whatever order BLAS
adds: that is the bound checked here, d from the sums' lengths (H*W in a row, then N rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import numpy_backend
from backends.numpy_backend import NumpyBackend, _channel_sum, batchnorm_backward_plain, batchnorm_forward_plain

U = 2.0**-24
BE = NumpyBackend()
SHAPES = [(2, 3, 1, 2), (8, 5, 6, 7), (64, 4, 32, 32), (2, 300, 16, 16), (3, 2, 300, 300)]


def _depth(shape: tuple[int, ...]) -> int:
    """The most roundings one term meets in a per-channel sum: a product, H*W in its row, N row sums."""
    n, _, h, w = shape
    return h * w + n + 1


@pytest.mark.parametrize("shape", SHAPES)
def test_channel_sums_are_within_the_bound_of_their_order(shape):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(shape) + 3.0).astype(np.float32)  # an offset: sums far from 0, as after a ReLU
    got = _channel_sum(a)
    exact = a.astype(np.float64).sum(axis=(0, 2, 3))
    bound = _depth(shape) * U * np.abs(a).astype(np.float64).sum(axis=(0, 2, 3))
    assert got.dtype == np.float32 and got.shape == (shape[1],)
    assert np.all(np.abs(got - exact) <= bound)


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (2 * rng.standard_normal(shape) + 0.5).astype(np.float32)
    gamma, beta = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = rng.standard_normal(c).astype(np.float32), (rng.random(c) + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    return x, gamma, beta, rm, rv, dy


def _float64_reference(x, gamma, beta, rm, rv, dy, training, eps=1e-5):
    """BatchNorm2D's docstring in float64: y, dx, dgamma, dbeta."""
    x, gamma, beta, dy = (a.astype(np.float64) for a in (x, gamma, beta, dy))
    ch = (None, slice(None), None, None)
    m = x.shape[0] * x.shape[2] * x.shape[3]
    mean, var = (x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))) if training else (rm, rv)
    invstd = 1 / np.sqrt(var.astype(np.float64) + eps)
    xhat = (x - mean[ch]) * invstd[ch]
    dbeta, dgamma = dy.sum(axis=(0, 2, 3)), (dy * xhat).sum(axis=(0, 2, 3))
    g = (gamma * invstd)[ch]
    dx = g * (dy - dbeta[ch] / m - xhat * dgamma[ch] / m) if training else g * dy
    return xhat * gamma[ch] + beta[ch], dx, dgamma, dbeta


@pytest.mark.parametrize("block", [numpy_backend.BLOCK, 50])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_optimised_batch_norm_equals_the_plain_one_and_float64(shape, training, block, monkeypatch):
    monkeypatch.setattr(numpy_backend, "BLOCK", block)
    x, gamma, beta, rm, rv, dy = _inputs(shape)
    originals = [a.copy() for a in (x, gamma, beta, dy)]
    rm_fast, rv_fast, rm_plain, rv_plain = rm.copy(), rv.copy(), rm.copy(), rv.copy()
    y, cache = BE.batchnorm_forward(x, gamma, beta, rm_fast, rv_fast, training)
    y_plain, cache_plain = batchnorm_forward_plain(x, gamma, beta, rm_plain, rv_plain, training)
    grads = BE.batchnorm_backward(dy, cache)
    grads_plain = batchnorm_backward_plain(dy, cache_plain)
    ref = _float64_reference(x, gamma, beta, rm, rv, dy, training)
    # each result is a few roundings of terms no larger than the map's: compare on that scale, with the
    # bound of the longest sum it took, a mean and a variance in the forward, two more in the backward;
    # the plain one is within the same bound of float64, so the two within twice it of each other
    d = _depth(shape)
    for got, plain, exact in zip((y, *grads), (y_plain, *grads_plain), ref, strict=True):
        assert got.dtype == np.float32 and got.shape == exact.shape
        bound = 8 * d * U * (np.abs(exact).max() + 1.0) * (1 if got.ndim == 4 else x.size / x.shape[1])
        assert np.abs(got - exact).max() <= bound
        assert np.abs(got.astype(np.float64) - plain).max() <= 2 * bound
    assert np.allclose(rm_fast, rm_plain, rtol=1e-5, atol=1e-6) and np.allclose(rv_fast, rv_plain, rtol=1e-5)
    if not training:
        assert np.array_equal(rm_fast, rm) and np.array_equal(rv_fast, rv)
    for before, after in zip(originals, (x, gamma, beta, dy), strict=True):
        assert np.array_equal(before, after)  # ops never modify their inputs


@pytest.mark.parametrize("layout", ["every other channel", "Fortran order"])
@pytest.mark.parametrize("training", [True, False])
def test_a_strided_map_gives_the_bits_of_a_contiguous_one(training, layout):
    """An input that is a view (every other channel of a bigger map, as a slice of kernels is) or in
    another memory order gives the same numbers as a contiguous copy, the backward's dy too."""
    x, gamma, beta, rm, rv, dy = _inputs((4, 6, 5, 5))
    if layout == "Fortran order":
        xs, dys = np.asfortranarray(x), np.asfortranarray(dy)
    else:
        xs, dys = (np.repeat(a, 2, axis=1)[:, ::2] for a in (x, dy))
    y, cache = BE.batchnorm_forward(x, gamma, beta, rm.copy(), rv.copy(), training)
    ys, cache_s = BE.batchnorm_forward(xs, gamma, beta, rm.copy(), rv.copy(), training)
    assert not xs.flags.c_contiguous and np.array_equal(y, ys)
    for a, b in zip(BE.batchnorm_backward(dy, cache), BE.batchnorm_backward(dys, cache_s), strict=True):
        assert np.array_equal(a, b)
