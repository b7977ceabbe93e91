"""The paper's eq. 1, largest-remainder kernel counts, and the Rebalancer (pure arithmetic)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyconv.balance import Rebalancer, kernel_counts, slices, speed_weights

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


def test_kernel_counts_sum_and_quota_property(rng):
    for _ in range(300):
        n = int(rng.integers(1, 7))
        weights = list(rng.uniform(0.1, 1.0, n))
        total = int(rng.integers(n, 600))
        counts = kernel_counts(weights, total)
        assert sum(counts) == total and len(counts) == n
        quotas = [total * w / sum(weights) for w in weights]
        # Hamilton's method: each participant gets its quota rounded down or up
        assert all(math.floor(q) <= c <= math.ceil(q) for c, q in zip(counts, quotas, strict=True)), (
            weights,
            total,
            counts,
        )
        assert kernel_counts(weights, total) == counts  # deterministic


def test_kernel_counts_two_times_slower_gets_a_third():
    assert kernel_counts(speed_weights([1.0, 2.0]), 48) == [32, 16]
    assert kernel_counts(speed_weights([1.0, 2.0]), 500) == [333, 167]  # 333.33 / 166.67


def test_kernel_counts_tie_breaks_larger_weight_then_lower_index():
    # quotas 0.75 each: the 1 left over goes to the first of the equal weights
    assert kernel_counts([1, 1, 1, 1], 3) == [1, 1, 1, 0]
    assert kernel_counts([1, 1, 1], 10) == [4, 3, 3]
    # quotas [0.5, 1.5, 0.5, 0.5]: both kernels left over tie on 0.5; the larger weight wins
    # first, then the lowest index
    assert kernel_counts([1, 3, 1, 1], 3) == [1, 2, 0, 0]


def test_kernel_counts_zero_weight_gets_nothing():
    assert kernel_counts([0, 1, 1], 5) == [0, 3, 2]
    assert kernel_counts([1, 0, 0], 7) == [7, 0, 0]
    assert kernel_counts([0.0, 2.0, 0.0, 1.0], 1) == [0, 1, 0, 0]


def test_kernel_counts_gives_every_positive_weight_a_kernel_when_there_are_enough():
    # 48 * 0.001/1.001 = 0.048 would round to 0; a participant at 0 could never be timed again
    assert kernel_counts([0.001, 1.0], 48) == [1, 47]
    assert kernel_counts([1.0, 0.001, 0.001], 10) == [8, 1, 1]
    # fewer kernels than participants: some must get 0
    assert kernel_counts([1, 1, 1, 1], 2) == [1, 1, 0, 0]
    assert kernel_counts([1.0, 2.0], 0) == [0, 0]


@pytest.mark.parametrize(
    "weights, total, match",
    [
        ([], 4, "at least one"),
        ([1.0, -1.0], 4, "weight 1"),
        ([1.0, float("nan")], 4, "weight 1"),
        ([0.0, 0.0], 4, "all weights are 0"),
        ([1.0], -1, "total_kernels"),
        ([1.0], 2.5, "total_kernels"),
    ],
)
def test_kernel_counts_rejects_bad_input(weights, total, match):
    with pytest.raises(ValueError, match=match):
        kernel_counts(weights, total)


def test_slices_are_contiguous_in_participant_order():
    assert slices([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]
    assert slices([5]) == [(0, 5)]
    with pytest.raises(ValueError, match=">= 0"):
        slices([2, -1])


# ---- the rebalancer --------------------------------------------------------------------------


def run(rebalancer, per_kernel, counts, steps, noise=0.0, rng=None, layer="conv1"):
    """Feed ``steps`` steps of times t_i = c_i * p_i * (1 + noise); apply proposals; return history."""
    history = [list(counts)]
    for _ in range(steps):
        times = [c * p for c, p in zip(counts, per_kernel, strict=True)]
        if noise:
            times = [t * (1 + rng.uniform(-noise, noise)) for t in times]
        proposal = rebalancer.observe(layer, counts, times)
        if proposal is not None:
            assert sum(proposal) == sum(counts) and len(proposal) == len(counts)
            counts = proposal
            history.append(list(counts))
    return counts, history


def test_two_times_slower_participant_ends_with_a_third():
    counts, history = run(Rebalancer(), per_kernel=[1e-3, 2e-3], counts=[24, 24], steps=40)
    assert counts == [32, 16]
    assert history == [[24, 24], [32, 16]]  # one move, no flapping back


def test_two_times_slower_converges_under_noise_within_a_couple_of_kernels():
    rng = np.random.default_rng(0)
    counts, history = run(Rebalancer(), [1e-3, 2e-3], [24, 24], steps=60, noise=0.10, rng=rng)
    assert abs(counts[1] - 16) <= 2, history
    assert len(history) <= 3, history


def test_three_participants_converge_to_speed_shares():
    # speeds 1 : 1/2 : 1/4 -> shares 4/7, 2/7, 1/7 of 70 kernels
    counts, _ = run(Rebalancer(), [1.0, 2.0, 4.0], [24, 23, 23], steps=40)
    assert counts == [40, 20, 10]


def test_equal_speeds_with_noise_do_not_flap():
    rng = np.random.default_rng(1)
    counts, history = run(Rebalancer(), [1e-3, 1e-3], [24, 24], steps=300, noise=0.15, rng=rng)
    assert history == [[24, 24]]
    rng = np.random.default_rng(2)
    counts, history = run(Rebalancer(), [1e-3, 1e-3, 1e-3], [16, 16, 16], steps=300, noise=0.15, rng=rng)
    assert history == [[16, 16, 16]]


def test_a_split_that_cannot_be_evener_is_kept():
    # 10 kernels over 3 equal participants: one has 4, lagging the mean by 20% for ever;
    # the best plan is the current one, so nothing is proposed
    counts, history = run(Rebalancer(), [1.0, 1.0, 1.0], [4, 3, 3], steps=50)
    assert history == [[4, 3, 3]]


def test_patience_and_threshold():
    # the slow one lags the mean finish by (12 - 9) / 9 = 33%: proposed on the third such step in a row
    r2 = Rebalancer(threshold=0.10, patience=3, smoothing=1.0)
    assert r2.observe("c", [6, 6], [6.0, 12.0]) is None
    assert r2.observe("c", [6, 6], [6.0, 12.0]) is None
    assert r2.observe("c", [6, 6], [6.0, 6.0]) is None  # balanced this step: streak reset
    assert r2.observe("c", [6, 6], [6.0, 12.0]) is None
    assert r2.observe("c", [6, 6], [6.0, 12.0]) is None
    assert r2.observe("c", [6, 6], [6.0, 12.0]) == [8, 4]
    # 5% slower lags the mean by 2.4%: under the threshold, never moved
    counts, history = run(Rebalancer(), [1.0, 1.05], [24, 24], steps=50)
    assert history == [[24, 24]]


def test_cooldown_after_a_rebalance():
    r = Rebalancer(patience=1, smoothing=1.0, cooldown=4)
    assert r.observe("c", [6, 6], [6.0, 12.0]) == [8, 4]
    # the slow one suddenly gets slower still, but the layer waits out its cool-down
    for _ in range(4):
        assert r.observe("c", [8, 4], [8.0, 16.0]) is None
    assert r.observe("c", [8, 4], [8.0, 16.0]) == [10, 2]


def test_layers_are_independent_and_estimates_are_exposed():
    r = Rebalancer(patience=1, smoothing=1.0)
    assert r.observe("conv1", [6, 6], [6.0, 6.0]) is None
    assert r.observe("conv2", [6, 6], [6.0, 12.0]) == [8, 4]
    assert r.per_kernel_times("conv1") == [1.0, 1.0]
    assert r.per_kernel_times("conv2") == [1.0, 2.0]
    assert r.per_kernel_times("conv9") == []


def test_participants_without_kernels_keep_their_estimate():
    r = Rebalancer(patience=1, smoothing=1.0)
    assert r.observe("c", [1, 0], [1.0, 0.0]) is None  # participant 1 never measured: no basis
    assert r.per_kernel_times("c") == [1.0, None]
    r.observe("c", [1, 1], [1.0, 2.0])
    r.observe("c", [2, 0], [2.0, 0.0])
    assert r.per_kernel_times("c") == [1.0, 2.0]


def test_rebalancer_rejects_bad_input():
    r = Rebalancer()
    with pytest.raises(ValueError, match="one time per participant"):
        r.observe("c", [1, 2], [1.0])
    with pytest.raises(ValueError, match="not a measurement"):
        r.observe("c", [1, 2], [1.0, float("nan")])
    r.observe("c", [1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="new Rebalancer"):
        r.observe("c", [1, 1, 1], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="patience"):
        Rebalancer(patience=0)
    with pytest.raises(ValueError, match="smoothing"):
        Rebalancer(smoothing=0.0)
