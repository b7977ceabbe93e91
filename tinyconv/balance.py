"""How many kernels each participant gets: the paper's speed weights, and rebalancing.

Everything here is pure arithmetic on small lists (no I/O, no clocks), so the
sharded convolution (``tinyconv/distributed.py``) can be read and tested apart
from it. A *participant* is anyone computing kernels: the master, if it takes
part, and each worker.

1. :func:`speed_weights` -- the paper's eq. 1. From each participant's time t_i
   for the same benchmark (a convolution of the layer's own shape)::

       w_i = (max_j t_j / t_i) / sum_k (max_j t_j / t_k)

   i.e. shares proportional to speed 1/t_i, normalised to sum to 1.
2. :func:`kernel_counts` -- turns weights into whole kernels that add up to the
   layer's F exactly (largest-remainder apportionment), and :func:`slices` into
   contiguous ranges [start, stop) of the weight tensor's rows.
3. :class:`Rebalancer` -- goes beyond the paper, whose split is fixed after the
   benchmark: it watches each step's measured compute times and moves kernels
   when one participant keeps finishing late.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
            raise ValueError(
                f"time {i} is {t!r}: every benchmark time must be a finite number of seconds > 0"
            )
    t_max = max(times)
    ratios = [t_max / t for t in times]
    total = sum(ratios)
    return [r / total for r in ratios]


def kernel_counts(weights: Sequence[float], total_kernels: int) -> list[int]:
    """Split ``total_kernels`` in proportion to ``weights``; the counts sum to it exactly.

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
    if not isinstance(total_kernels, int) or isinstance(total_kernels, bool) or total_kernels < 0:
        raise ValueError(f"total_kernels must be an int >= 0, got {total_kernels!r}")
    if len(weights) == 0:
        raise ValueError("kernel_counts needs at least one weight")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight {i} is {w!r}: weights must be finite numbers >= 0")
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact)
    if weight_sum == 0:
        raise ValueError("all weights are 0: at least one participant must be able to take kernels")

    quotas = [total_kernels * w / weight_sum for w in exact]
    counts = [math.floor(q) for q in quotas]
    left = total_kernels - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), -exact[i], i))
    for i in by_remainder[:left]:
        counts[i] += 1

    positive = [i for i, w in enumerate(exact) if w > 0]
    if total_kernels >= len(positive):
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


@dataclass
class _LayerState:
    """What the Rebalancer remembers about one layer."""

    per_kernel: list[float | None] = field(default_factory=list)  # smoothed seconds per kernel
    late_steps: int = 0  # consecutive steps the slowest participant lagged
    cooldown: int = 0  # steps left before another rebalance may be proposed


class Rebalancer:
    """Proposes a new kernel split when measured compute times say the current one is off.

    Fed once per step and layer with each participant's kernel count c_i and its
    measured compute time t_i for that layer (forward + backward), it keeps an
    exponentially smoothed time per kernel::

        p_i <- smoothing * (t_i / c_i) + (1 - smoothing) * p_i

    (participants with no kernels this step keep their estimate). With the
    current counts, participant i is predicted to finish after f_i = c_i p_i.
    When the slowest lags the mean of those finishing times by more than
    ``threshold``, (max f - mean f) / mean f > threshold, for ``patience``
    consecutive steps, it proposes counts from eq. 1 applied to the per-kernel
    times p_i (that is, shares proportional to 1/p_i), which equalises the f_i.

    Hysteresis, so noise does not make the split flap: the smoothing, the
    patience, a proposal must move at least ``min_move`` kernels (one layer's
    counts change by sum |new - old| / 2 kernels), and after a rebalance the layer
    waits ``cooldown`` steps (its streak and proposals start again from zero).

    Per-kernel time assumes a participant's time grows in proportion to its
    kernels. Costs that do not (each participant builds im2col columns of the
    whole input) make a proposal over-correct a little; the next measurements
    correct it back.
    """

    def __init__(
        self,
        threshold: float = 0.10,
        patience: int = 3,
        smoothing: float = 0.3,
        cooldown: int = 5,
        min_move: int = 1,
    ) -> None:
        if not threshold >= 0:
            raise ValueError(
                f"threshold must be >= 0 (a fraction of the mean finish time), got {threshold!r}"
            )
        if not (isinstance(patience, int) and patience >= 1):
            raise ValueError(f"patience must be an int >= 1 (steps), got {patience!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1] (1 = no smoothing), got {smoothing!r}")
        if not (isinstance(cooldown, int) and cooldown >= 0):
            raise ValueError(f"cooldown must be an int >= 0 (steps), got {cooldown!r}")
        if not (isinstance(min_move, int) and min_move >= 1):
            raise ValueError(f"min_move must be an int >= 1 (kernels), got {min_move!r}")
        self.threshold = threshold
        self.patience = patience
        self.smoothing = smoothing
        self.cooldown = cooldown
        self.min_move = min_move
        self._layers: dict[str, _LayerState] = {}

    def per_kernel_times(self, layer: str) -> list[float | None]:
        """The smoothed seconds per kernel of each participant (None: never measured)."""
        return list(self._layers[layer].per_kernel) if layer in self._layers else []

    def observe(self, layer: str, counts: Sequence[int], times: Sequence[float]) -> list[int] | None:
        """Record one step of ``layer``; return new counts to use from the next step, or None.

        ``counts[i]`` kernels took participant i ``times[i]`` seconds (ignored when
        counts[i] is 0). A returned plan sums to sum(counts) and has the same length.
        """
        if len(counts) != len(times) or len(counts) == 0:
            raise ValueError(
                f"need one time per participant, got counts {list(counts)} and times {list(times)}"
            )
        for i, (c, t) in enumerate(zip(counts, times, strict=True)):
            if c < 0 or (c > 0 and not (math.isfinite(t) and t >= 0)):
                raise ValueError(f"participant {i}: {c} kernels in {t!r} s is not a measurement")
        state = self._layers.setdefault(layer, _LayerState(per_kernel=[None] * len(counts)))
        if len(state.per_kernel) != len(counts):
            raise ValueError(
                f"layer {layer!r} had {len(state.per_kernel)} participants, now {len(counts)}; "
                "use a new Rebalancer when the set of participants changes"
            )

        for i, (c, t) in enumerate(zip(counts, times, strict=True)):
            if c > 0:
                p = t / c
                old = state.per_kernel[i]
                state.per_kernel[i] = p if old is None else self.smoothing * p + (1 - self.smoothing) * old

        if state.cooldown > 0:
            state.cooldown -= 1
            return None
        if any(p is None or p <= 0 for p in state.per_kernel):
            return None  # someone has never been measured (or reports no time): nothing to compare
        per_kernel = [p for p in state.per_kernel if p is not None]
        finish = [c * p for c, p in zip(counts, per_kernel, strict=True) if c > 0]
        mean = sum(finish) / len(finish)
        lag = (max(finish) - mean) / mean if mean > 0 else 0.0
        state.late_steps = state.late_steps + 1 if lag > self.threshold else 0
        if state.late_steps < self.patience:
            return None

        state.late_steps = 0
        proposal = kernel_counts(speed_weights(per_kernel), sum(counts))
        moved = sum(abs(a - b) for a, b in zip(proposal, counts, strict=True)) // 2
        if moved < self.min_move:
            return None
        state.cooldown = self.cooldown
        return proposal
