"""Grades lesson 5 against tinyconv.distributed.shard.balance and the unsplit convolution, on fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

import tinyconv as tc
from tinyconv.distributed.shard.balance import apportion, speed_weights

LESSON = "05_split_by_kernels"


@pytest.mark.parametrize("times", [[1.0, 2.0, 4.0], [0.3], [0.2, 0.25, 0.3, 0.9], [5, 5, 5]])
def test_eq1_weights(lesson, times):
    got = lesson.eq1_weights(times)
    assert len(got) == len(times)
    np.testing.assert_allclose(got, speed_weights(times), rtol=1e-12)


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -2.0], [float("nan")], [float("inf"), 1.0]])
def test_eq1_weights_refuses_bad_times(lesson, bad):
    with pytest.raises(ValueError):
        lesson.eq1_weights(bad)


def test_largest_remainder_against_tinyconv_on_random_weights(lesson):
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = list(rng.uniform(0.5, 3.0, rng.integers(1, 7)))
        total = int(rng.integers(len(weights), 200))  # every quota >= 1 here, where apportion adds no floor
        if min(weights) / sum(weights) * total < 1:
            continue
        got = lesson.largest_remainder(weights, total)
        assert sum(got) == total and list(got) == apportion(weights, total), (weights, total, got)


def test_largest_remainder_breaks_ties_exactly(lesson):
    assert list(lesson.largest_remainder([1, 1, 1], 32)) == [11, 11, 10]
    assert list(lesson.largest_remainder([0.1, 0.2, 0.7], 10)) == [1, 2, 7]  # no float noise: 0.1 * 10 is 1


@pytest.mark.parametrize("counts", [[4, 3, 3], [10, 0, 0], [0, 7, 3], [1, 1, 1, 1, 6]])
def test_conv_by_kernels_is_the_whole_convolution(lesson, counts):
    rng = np.random.default_rng(sum(counts) + len(counts))
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    w, b = rng.standard_normal((10, 3, 3, 3)).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    want, _ = tc.get_backend("numpy").conv2d_forward(x, w, b, 2, 1)
    got = np.asarray(lesson.conv_by_kernels(x, w, b, counts, 2, 1))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # a GEMM of fewer rows may round differently
