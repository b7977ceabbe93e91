"""The affine cost model t_i(k) = a_i + b_i k the rebalancer (``rebalance.py``) moves kernels by (why affine:
docs/how-it-works.md): :func:`fit_affine_cost` fits the line, :func:`equal_finish_kernels` solves for the split
that makes everyone finish together, and :func:`whole_by_finish` makes that split whole. Pure arithmetic on small
lists: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_SLOPE_SHARE = 0.05  # a fitted b is at least this share of the time per kernel now, t0 / k0
SLOPE_CONFIDENCE = 2.0  # the slope used is the fitted one plus this many standard errors


def fit_affine_cost(samples: Sequence[tuple[int, float]], smoothing: float) -> tuple[float, float] | None:
    """Fit t = a + b k to one participant's measurements (k kernels, t seconds), oldest first: (a, b), or None
    with no measurement, or no time (t0 <= 0).

    Weights: the newest measurement weighs 1 and each older one ``1 - smoothing`` times the next newer. The line
    passes through (k0, t0), the newest k and the weighted mean time at it: the plan in use, whose time it then
    predicts as measured; only the slope comes from the other k (:func:`_steepest_slope`). A slope too small makes
    kernels look nearly free, so the target would pile them onto (or strip them from) one participant: the slope
    is the steepest the measurements allow, clamped to [MIN_SLOPE_SHARE * p0, p0] with p0 = t0 / k0, the time per
    kernel now, and a = t0 - b k0 >= 0. With fewer than two distinct k there is no slope: the proportional (0, p0).
    """
    weighted = [((1.0 - smoothing) ** age, k, t) for age, (k, t) in enumerate(reversed(samples))]
    weighted = [(w, k, t) for w, k, t in weighted if w > 0]
    if not weighted:
        return None
    k0 = weighted[0][1]
    t0 = sum(w * t for w, k, t in weighted if k == k0) / sum(w for w, k, _ in weighted if k == k0)
    if not t0 > 0:
        return None
    p0 = t0 / k0
    if len({k for _, k, _ in weighted}) < 2:
        return 0.0, p0
    b = _steepest_slope(weighted)
    b = min(max(p0 if b is None else b, MIN_SLOPE_SHARE * p0), p0)
    return max(0.0, t0 - b * k0), b


def _steepest_slope(weighted: Sequence[tuple[float, int, float]]) -> float | None:
    """The slope of :func:`fit_affine_cost` from (w_j, k_j, t_j) with at least two distinct k: exponentially
    weighted least squares plus SLOPE_CONFIDENCE standard errors (a steeper line moves fewer kernels, and a move
    that falls short is completed at the next rebalance, which also has another k to fit). With W = sum_j w_j
    and weighted means k_bar, t_bar::

        S_kk = sum_j w_j (k_j - k_bar)^2,     b_ls = sum_j w_j (k_j - k_bar)(t_j - t_bar) / S_kk
        se(b_ls)^2 = s^2 sum_j w_j^2 (k_j - k_bar)^2 / S_kk^2
        s^2 = (sum_j w_j r_j^2 / W) n / (n - 2),   r_j = t_j - t_bar - b_ls (k_j - k_bar),   n = W^2 / sum_j w_j^2

    (s^2: the noise variance from the residuals; n: the effective number of measurements.) None when n <= 2
    leaves no residual to judge the noise by, or when b_ls <= 0: no cost falls as kernels are added, the
    conditions changed (another job started there, say), and no fixed part can be told from them."""
    total = sum(w for w, _, _ in weighted)
    k_bar = sum(w * k for w, k, _ in weighted) / total
    t_bar = sum(w * t for w, _, t in weighted) / total
    s_kk = sum(w * (k - k_bar) ** 2 for w, k, _ in weighted)
    b_ls = sum(w * (k - k_bar) * (t - t_bar) for w, k, t in weighted) / s_kk
    n_eff = total**2 / sum(w * w for w, _, _ in weighted)
    if n_eff <= 2 or b_ls <= 0:
        return None
    residual = sum(w * (t - t_bar - b_ls * (k - k_bar)) ** 2 for w, k, t in weighted) / total
    s2 = residual * n_eff / (n_eff - 2)
    return b_ls + SLOPE_CONFIDENCE * math.sqrt(s2 * sum(w * w * (k - k_bar) ** 2 for w, k, _ in weighted)) / s_kk


def equal_finish_kernels(costs: Sequence[tuple[float, float]], total_kernels: int) -> list[float]:
    """Real-valued kernel counts that make participants with costs t_i(k) = a_i + b_i k (a_i >= 0 fixed
    seconds, b_i > 0 seconds per kernel) finish together: at T, with k_i = (T - a_i) / b_i and sum_i k_i = F::

        T = (F + sum_i a_i / b_i) / sum_i (1 / b_i)

    A floor: every participant gets at least 1 kernel when F >= the number of participants (so it keeps being
    measured), else at least 0. Whoever's k_i falls below the floor is held at it, and T is solved again for
    the others with the floor's kernels taken out, until nobody falls below (each pass can only lower T, so the
    held stay held). With every a_i = 0 and no one held, k_i = F (1/b_i) / sum_j (1/b_j): eq. 1. The counts
    sum to F (up to round-off); :func:`whole_by_finish` makes them whole.
    """
    n = len(costs)
    if total_kernels == 0:
        return [0.0] * n
    floor = 1.0 if total_kernels >= n else 0.0
    held: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in held]
        if not free:  # everyone at the floor: F = n
            return [floor] * n
        rest = total_kernels - floor * (n - len(free))
        finish = (rest + sum(costs[i][0] / costs[i][1] for i in free)) / sum(1 / costs[i][1] for i in free)
        below = [i for i in free if (finish - costs[i][0]) / costs[i][1] < floor - 1e-9]
        if not below:
            break
        held.update(below)
    return [floor if i in held else max(0.0, (finish - a) / b) for i, (a, b) in enumerate(costs)]


def whole_by_finish(costs: Sequence[tuple[float, float]], shares: Sequence[float], total: int) -> list[int]:
    """The real ``shares`` (:func:`equal_finish_kernels`) made whole, summing to ``total``, by finish time: the
    floors, then each unit left to whoever finishes soonest with one more, a_i + b_i (c_i + 1) (ties: the lower
    index): the least makespan of the whole splits at or above the floors (largest remainder's can be later)."""
    counts = [math.floor(s + 1e-6) for s in shares]  # the sum of the floors is at most total: shares sum to it
    for _ in range(total - sum(counts)):
        i = min(range(len(counts)), key=lambda j: (costs[j][0] + costs[j][1] * (counts[j] + 1), j))
        counts[i] += 1
    return counts
