"""Grades lesson 1's exercises against tinyconv's numpy reference, on fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

import tinyconv as tc
from backends.numpy_backend import im2col

LESSON = "01_convolution_by_hand"
# (N, C, H, W, F, K, stride, padding): odd sizes, stride 2, padding 0..2, one channel, batch 1
CASES = [(2, 3, 7, 7, 4, 3, 1, 1), (1, 2, 9, 8, 3, 5, 2, 2), (3, 1, 6, 6, 2, 2, 2, 0), (1, 4, 5, 5, 5, 5, 1, 0)]


def inputs(case: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, c, h, w, f, k, _, _ = case
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c, k, k)), rng.standard_normal(f)


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, padding: int) -> np.ndarray:
    y, _ = tc.get_backend("numpy").conv2d_forward(x, w, b, stride=stride, padding=padding)  # float64 in, out
    return y


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
@pytest.mark.parametrize("name", ["conv2d_loops", "conv2d_gemm"])
def test_convolution_equals_the_reference(lesson, name, seed, case):
    x, w, b = inputs(case, seed)
    stride, padding = case[6], case[7]
    got = np.asarray(getattr(lesson, name)(x, w, b, stride, padding))
    want = reference(x, w, b, stride, padding)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected (N, F, OH, OW) = {want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"{name} on {case}")


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_im2col_equals_tinyconvs(lesson, seed, case):
    x, _, _ = inputs(case, seed)
    k, stride, padding = case[5], case[6], case[7]
    got = np.asarray(lesson.im2col_loops(x, k, stride, padding))
    want = im2col(x, k, k, stride, padding)
    assert got.shape == want.shape, f"im2col_loops: shape {got.shape}, expected (C*K*K, N*OH*OW) = {want.shape}"
    np.testing.assert_array_equal(got, want, err_msg="rows must be (c, i, j), columns (n, oh, ow)")


def test_float32_in_float32_out(lesson):
    x, w, b = (a.astype(np.float32) for a in inputs(CASES[0], 0))
    assert lesson.conv2d_gemm(x, w, b, 1, 1).dtype == np.float32, "keep the input's dtype (NCHW float32)"
