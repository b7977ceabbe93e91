"""How many kernels each participant gets: the paper's split (Marques et al. 2017).

Pure arithmetic on small lists: :func:`speed_weights` is the paper's eq. 1 (times -> weights),
:func:`apportion` turns weights into whole kernels (or input channels, or images) that add up
exactly, and :func:`slices` into contiguous ranges. The paper fixes the split after the benchmark;
moving kernels as the measured step times change goes beyond it, in :mod:`tinyconv.distributed.rebalance`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction


def speed_weights(times: Sequence[float]) -> list[float]:
    """The paper's eq. 1: times (seconds, one per participant) -> weights summing to 1.

    w_i = (max t / t_i) / sum_j (max t / t_j). A participant twice as slow gets
    half the weight: times [1, 2] -> weights [2/3, 1/3].
    """
    if len(times) == 0:
        raise ValueError("speed_weights needs at least one time")
    for i, t in enumerate(times):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"time {i} is {t!r}: every benchmark time must be a finite number of seconds > 0")
    t_max = max(times)
    ratios = [t_max / t for t in times]
    total = sum(ratios)
    return [r / total for r in ratios]


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` units (kernels, input channels, images) in proportion to ``weights``; the
    counts sum to it exactly.

    Largest remainder (Hamilton's method): participant i's quota is
    q_i = total * w_i / sum(w); each gets floor(q_i), and the kernels left over go,
    one each, to the largest fractional parts q_i - floor(q_i). Ties go to the
    larger weight, then to the lower index, so the result is deterministic. The
    arithmetic is exact (fractions), so float noise cannot break a tie.

    Zeros: a participant with weight 0 gets 0 kernels. Every participant with a
    positive weight gets at least 1 kernel whenever there are at least as many
    kernels as such participants (otherwise some must get 0): a participant at 0
    would never be timed again, so a later rebalance could never give it work back.
    Such a kernel is taken from whoever holds the most above its quota.
    """
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ValueError(f"total must be an int >= 0 (the units to apportion), got {total!r}")
    if len(weights) == 0:
        raise ValueError("apportion needs at least one weight")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight {i} is {w!r}: weights must be finite numbers >= 0")
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact)
    if weight_sum == 0:
        raise ValueError("all weights are 0: at least one participant must be able to take kernels")

    quotas = [total * w / weight_sum for w in exact]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), -exact[i], i))
    for i in by_remainder[:left]:
        counts[i] += 1

    positive = [i for i, w in enumerate(exact) if w > 0]
    if total >= len(positive):
        for i in positive:
            if counts[i] == 0:
                donor = max(
                    (j for j in range(len(counts)) if counts[j] >= 2),
                    key=lambda j: (counts[j] - quotas[j], -j),
                )
                counts[donor] -= 1
                counts[i] = 1
    return counts


def slices(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Kernel counts -> contiguous [start, stop) row ranges, in participant order.

    [3, 0, 2] -> [(0, 3), (3, 3), (3, 5)].
    """
    out = []
    start = 0
    for c in counts:
        if c < 0:
            raise ValueError(f"kernel counts must be >= 0, got {list(counts)}")
        out.append((start, start + c))
        start += c
    return out
