"""The paper's eq. 1, largest-remainder kernel counts, and slices (pure arithmetic)."""

from __future__ import annotations

import math

import pytest

from tinyconv.distributed.shard.balance import apportion, slices, speed_weights

# ---- eq. 1 ---------------------------------------------------------------------------


def test_speed_weights_is_eq1_on_benchmark_times():
    # four CPUs of different speed timing the same convolution (seconds)
    times = [1.2, 1.5, 2.4, 3.0]
    # w_i = (max t / t_i) / sum_j (max t / t_j) = [2.5, 2, 1.25, 1] / 6.75
    expected = [2.5 / 6.75, 2.0 / 6.75, 1.25 / 6.75, 1.0 / 6.75]
    assert speed_weights(times) == pytest.approx(expected, rel=1e-12)
    assert math.fsum(speed_weights(times)) == pytest.approx(1.0, abs=1e-15)


def test_speed_weights_are_proportional_to_speed():
    assert speed_weights([1.0, 2.0]) == pytest.approx([2 / 3, 1 / 3])
    assert speed_weights([0.3, 0.3, 0.3]) == pytest.approx([1 / 3] * 3)
    assert speed_weights([5.0]) == [1.0]
    # only ratios matter: the unit of time does not
    assert speed_weights([2e-3, 5e-3, 1e-3]) == pytest.approx(speed_weights([2.0, 5.0, 1.0]))


@pytest.mark.parametrize("times", [[], [1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf")]])
def test_speed_weights_rejects_non_times(times):
    with pytest.raises(ValueError, match="time|at least one"):
        speed_weights(times)


# ---- largest remainder ------------------------------------------------------------------


def test_apportion_sum_and_quota_property(rng):
    for _ in range(300):
        n = int(rng.integers(1, 7))
        weights = list(rng.uniform(0.1, 1.0, n))
        total = int(rng.integers(n, 600))
        counts = apportion(weights, total)
        assert sum(counts) == total and len(counts) == n
        quotas = [total * w / sum(weights) for w in weights]
        # Hamilton's method: each participant gets its quota rounded down or up
        assert all(math.floor(q) <= c <= math.ceil(q) for c, q in zip(counts, quotas, strict=True)), (
            weights,
            total,
            counts,
        )
        assert apportion(weights, total) == counts  # deterministic


def test_apportion_two_times_slower_gets_a_third():
    assert apportion(speed_weights([1.0, 2.0]), 48) == [32, 16]
    assert apportion(speed_weights([1.0, 2.0]), 500) == [333, 167]  # 333.33 / 166.67


def test_apportion_tie_breaks_larger_weight_then_lower_index():
    # quotas 0.75 each: the 1 left over goes to the first of the equal weights
    assert apportion([1, 1, 1, 1], 3) == [1, 1, 1, 0]
    assert apportion([1, 1, 1], 10) == [4, 3, 3]
    # quotas [0.5, 1.5, 0.5, 0.5]: both kernels left over tie on 0.5; the larger weight wins
    # first, then the lowest index
    assert apportion([1, 3, 1, 1], 3) == [1, 2, 0, 0]


def test_apportion_zero_weight_gets_nothing():
    assert apportion([0, 1, 1], 5) == [0, 3, 2]
    assert apportion([1, 0, 0], 7) == [7, 0, 0]
    assert apportion([0.0, 2.0, 0.0, 1.0], 1) == [0, 1, 0, 0]


def test_apportion_gives_every_positive_weight_a_kernel_when_there_are_enough():
    # 48 * 0.001/1.001 = 0.048 would round to 0; a participant at 0 could never be timed again
    assert apportion([0.001, 1.0], 48) == [1, 47]
    assert apportion([1.0, 0.001, 0.001], 10) == [8, 1, 1]
    # fewer kernels than participants: some must get 0
    assert apportion([1, 1, 1, 1], 2) == [1, 1, 0, 0]
    assert apportion([1.0, 2.0], 0) == [0, 0]


@pytest.mark.parametrize(
    "weights, total, match",
    [
        ([], 4, "at least one"),
        ([1.0, -1.0], 4, "weight 1"),
        ([1.0, float("nan")], 4, "weight 1"),
        ([0.0, 0.0], 4, "all weights are 0"),
        ([1.0], -1, "total must be"),
        ([1.0], 2.5, "total must be"),
    ],
)
def test_apportion_rejects_bad_input(weights, total, match):
    with pytest.raises(ValueError, match=match):
        apportion(weights, total)


def test_slices_are_contiguous_in_participant_order():
    assert slices([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]
    assert slices([5]) == [(0, 5)]
    with pytest.raises(ValueError, match=">= 0"):
        slices([2, -1])
