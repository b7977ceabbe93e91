"""float32_tolerance (backends.conformance.runner): every summation order passes, a real bug does not.

The rigorous form must hold for any order of the same float32 sums -- here a convolution
split by kernels and by input channels (as the cluster splits it), and a reduction summed
forwards, backwards and pairwise -- and must still fail a dropped term or a wrong kernel slice.
"""

from __future__ import annotations

import numpy as np
import pytest
from float32_expected import Expected, assert_close, conv2d_expected

from backends.conformance.runner import float32_tolerance, gamma
from backends.numpy_backend import NumpyBackend

REF = NumpyBackend()
F32 = np.float32


@pytest.fixture
def conv(rng):
    """The paper's 5x5 "same" convolution on a small batch, with a gradient: (x, w, b, dy)."""
    x = rng.standard_normal((2, 6, 8, 8), dtype=F32)
    w = (rng.standard_normal((7, 6, 5, 5)) * 0.2).astype(F32)
    b = rng.standard_normal(7, dtype=F32)
    dy = rng.standard_normal((2, 7, 8, 8), dtype=F32)
    return x, w, b, dy


def by_kernels(x, w, b, spans):
    """The convolution's output, each span of kernels computed on its own (the paper's split)."""
    return np.concatenate([REF.conv2d_forward(x, w[s:e], b[s:e], 1, 2)[0] for s, e in spans], axis=1)


def by_channels(x, w, b, spans):
    """The convolution's output as the sum of partial convolutions over input channel spans."""
    zero = np.zeros_like(b)
    partials = [REF.conv2d_forward(x[:, s:e], w[:, s:e], zero, 1, 2)[0] for s, e in spans]
    return sum(partials[1:], partials[0]) + b[None, :, None, None]


def test_gamma_is_the_bound_of_k_roundings():
    assert gamma(0) == 0.0 and gamma(1) == pytest.approx(2.0**-24, rel=1e-7)
    assert gamma(1000) > 1000 * 2.0**-24  # k u / (1 - k u), not k u
    with pytest.raises(ValueError, match="k must be in"):
        gamma(-1)


def test_other_summation_orders_pass_and_are_within_half_of_it_of_the_exact_value(conv):
    x, w, b, dy = conv
    y, dx, dw, db = conv2d_expected(x, w, b, 1, 2, dy)
    assert (y.k, dx.k, dw.k, db.k) == (6 * 25 + 1, 7 * 25, 2 * 8 * 8, 2 * 8 * 8)
    assert_close(by_kernels(x, w, b, [(0, 2), (2, 3), (3, 7)]), y)
    assert_close(by_channels(x, w, b, [(0, 1), (1, 4), (4, 6)]), y)
    # each float32 result is within gamma_k * terms of the exact one: half the tolerance
    exact = REF.conv2d_forward(*(a.astype(np.float64) for a in (x, w, b)), 1, 2)[0]
    assert np.all(np.abs(y.value - exact) <= y.tolerance() / 2)


def test_a_reduction_summed_in_any_order_passes(rng):
    # one dw entry's 4096 products: forwards, backwards, pairwise, and in float64 rounded once
    t = rng.standard_normal(4096, dtype=F32) * rng.standard_normal(4096, dtype=F32)
    forwards = np.float32(0)
    for v in t:
        forwards = np.float32(forwards + v)
    backwards = np.float32(0)
    for v in t[::-1]:
        backwards = np.float32(backwards + v)
    expected = Expected(np.asarray(forwards), t.size, np.abs(t.astype(np.float64)).sum())
    for other in (backwards, t.sum(dtype=F32), F32(t.astype(np.float64).sum())):
        assert_close(np.asarray(other), expected)


def test_a_dropped_term_fails(conv):
    x, w, b, _ = conv
    (y,) = conv2d_expected(x, w, b, 1, 2)
    dropped = w.copy()
    dropped[:, 5, 4, 4] = 0  # one tap of one input channel: 1 of the 151 terms of every output
    with pytest.raises(AssertionError, match=r"differ by more than float32_tolerance\(k=151\)"):
        assert_close(REF.conv2d_forward(x, dropped, b, 1, 2)[0], y)


def test_a_wrong_kernel_slice_fails(conv):
    x, w, b, _ = conv
    (y,) = conv2d_expected(x, w, b, 1, 2)
    wrong = np.concatenate([REF.conv2d_forward(x, w[s:e], b[s:e], 1, 2)[0] for s, e in [(0, 2), (3, 4), (3, 7)]], 1)
    with pytest.raises(AssertionError, match="the worst, at"):
        assert_close(wrong, y)  # kernel 2's maps computed with kernel 3's weights
    with pytest.raises(AssertionError):
        assert_close(by_channels(x, w, b, [(0, 1), (2, 6)]), y)  # one channel's partial never added


def test_a_term_dropped_from_a_long_reduction_fails(conv):
    # dw sums 2*8*8 = 128 products: one image's one pixel missing is still far beyond round-off
    x, w, b, dy = conv
    _, _, dw, _ = conv2d_expected(x, w, b, 1, 2, dy)
    short = dy.copy()
    short[1, :, 7, 7] = 0
    _, cache = REF.conv2d_forward(x, w, b, 1, 2)
    with pytest.raises(AssertionError, match=r"float32_tolerance\(k=128\)"):
        assert_close(REF.conv2d_backward(short, cache)[1], dw)


def test_the_scale_form_fails_a_relative_error_well_below_a_bug(rng):
    # k = 1000 allows 2 gamma_1000 = 1.2e-4 of the largest entry; a bug's 1e-3 is out
    ref = rng.standard_normal((4, 5), dtype=F32)
    assert float32_tolerance(1000, 1.0) == pytest.approx(2 * gamma(1000))
    assert_close(ref * F32(1 + 1e-5), Expected(ref, 1000))
    with pytest.raises(AssertionError):
        assert_close(ref + F32(1e-3) * np.abs(ref).max(), Expected(ref, 1000))
