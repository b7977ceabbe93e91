"""Grades lesson 2's backwards against the numpy reference backend's, in float64, on fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

import tinyconv as tc
from tinyconv.gradcheck import rel_error

LESSON = "02_backprop"
be = tc.get_backend("numpy")
RIGHT = 1e-9  # float64: a right backward agrees to ~1e-14; a wrong one is off by far more than this


def close(got, want, what: str) -> None:
    got = np.asarray(got)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape}, expected {np.shape(want)}"
    assert rel_error(got, np.asarray(want)) < RIGHT, f"{what}: relative error {rel_error(got, np.asarray(want)):.1e}"


@pytest.mark.parametrize("seed", [0, 1])
def test_relu(lesson, seed):
    rng = np.random.default_rng(seed)
    x, dy = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4))
    _, cache = be.relu_forward(x)
    close(lesson.relu_backward(dy, x), be.relu_backward(dy, cache), "relu_backward")


@pytest.mark.parametrize("seed,shape,k", [(0, (2, 3, 4, 4), 2), (1, (1, 2, 6, 9), 3), (2, (2, 1, 5, 5), 2)])
def test_maxpool(lesson, seed, shape, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x[0, 0, 0, :2] = 7.0  # a tie: the first maximum takes the gradient
    y, cache = be.maxpool_forward(x, k, k, 0)
    dy = rng.standard_normal(y.shape)
    close(lesson.maxpool_backward(dy, x, k), be.maxpool_backward(dy, cache), "maxpool_backward")


@pytest.mark.parametrize("seed", [0, 1])
def test_linear(lesson, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((4, 6)), rng.standard_normal((3, 6)), rng.standard_normal(3)
    _, cache = be.linear_forward(x, w, b)
    dy = rng.standard_normal((4, 3))
    mine, ref = lesson.linear_backward(dy, x, w), be.linear_backward(dy, cache)
    for name, got, want in zip(("dx", "dw", "db"), mine, ref, strict=True):
        close(got, want, f"linear_backward {name}")


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 300.0)])  # 300: exp overflows unless shifted
def test_softmax_cross_entropy(lesson, seed, scale):
    rng = np.random.default_rng(seed)
    z, labels = rng.standard_normal((5, 7)) * scale, rng.integers(0, 7, 5)
    loss, dz = lesson.softmax_cross_entropy(z, labels)
    ref_loss, ref_dz = be.softmax_cross_entropy(z, labels)
    assert np.isfinite(loss) and abs(loss - ref_loss) <= RIGHT * max(1.0, abs(ref_loss)), (loss, ref_loss)
    close(dz, ref_dz, "softmax_cross_entropy dlogits")


@pytest.mark.parametrize("seed,stride,padding", [(0, 1, 0), (1, 2, 1), (2, 1, 2)])
def test_conv2d(lesson, seed, stride, padding):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    y, cache = be.conv2d_forward(x, w, b, stride, padding)
    dy = rng.standard_normal(y.shape)
    got = lesson.conv2d_backward(dy, x, w, stride, padding)
    for name, g, want in zip(("dx", "dw", "db"), got, be.conv2d_backward(dy, cache, True), strict=True):
        close(g, want, f"conv2d_backward {name}")


@pytest.mark.parametrize(
    "seed,size,alpha,beta,k", [(0, 5, 1e-1, 0.75, 1.0), (1, 4, 0.5, 0.6, 2.0), (2, 3, 1e-2, 0.75, 2.0)]
)
def test_lrn_with_its_cross_channel_term(lesson, seed, size, alpha, beta, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 7, 3, 3)) * 4  # large enough that the cross-channel term matters
    _, cache = be.lrn_forward(x, size, alpha, beta, k)
    dy = rng.standard_normal(x.shape)
    close(lesson.lrn_backward(dy, x, size, alpha, beta, k), be.lrn_backward(dy, cache), "lrn_backward")
