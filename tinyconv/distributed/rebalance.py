"""Beyond the paper: moving kernels as the measured step times change (:class:`Rebalancer`).

Each participant's time is an affine function of its kernels (``cost.py``), measured as how long its share
takes to be *ready at the master* (``LayerStep.ready_s``: a worker's compute plus its bytes at its link's
seconds per byte), and the split aims to make everyone finish together. Pure arithmetic on small lists: no
I/O, no clocks. The model, the target, when to move, sitting out and the phases: docs/how-it-works.md,
"How many kernels (or channels) each participant gets".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from tinyconv.distributed.cost import equal_finish_kernels, fit_affine_cost, whole_by_finish


class Phase(Enum):
    """Where one layer of a :class:`Rebalancer` is between steps (the transitions: docs/how-it-works.md)."""

    WATCHING = "watching"  # judging each step: counting the steps in a row that the slowest lags
    COOLING = "cooling"  # after a move: measuring, not judging, for ``cooldown`` steps
    PROBING = "probing"  # a participant that sat out has one kernel back for this step, judged at once


@dataclass
class _LayerState:
    """What the Rebalancer remembers about one layer."""

    samples: list[deque[tuple[int, float]]]  # per participant: its recent (kernels, seconds), oldest first
    idle: list[int]  # per participant: consecutive steps without kernels
    reprobe_in: list[int]  # per participant: steps without kernels before it is measured again
    steps: int = 0  # training steps observed: the calibration's samples, then the first step's, make way
    late_steps: int = 0  # WATCHING: consecutive steps the slowest participant lagged
    cooldown_left: int = 0  # COOLING: steps before the layer is judged again (a re-probe pauses it)
    probing: int | None = None  # PROBING: the participant given one kernel back, this step

    @property
    def phase(self) -> Phase:
        if self.probing is not None:
            return Phase.PROBING
        return Phase.COOLING if self.cooldown_left > 0 else Phase.WATCHING


@dataclass
class Rebalancer:
    """Proposes a new kernel split when measured times (compute, and a worker's transfers) say the current one is off.

    For each layer and participant it keeps the last ``window`` measurements (k, t) of training steps, from
    :meth:`observe`, and fits t_i(k) = a_i + b_i k (:func:`fit_affine_cost`; proportional until the steps saw two
    k). The target is the equal-finish split with a floor of one kernel (:func:`equal_finish_kernels`), from which
    a participant that can only slow the layer sits out. With the current counts c_i each finishes after
    f_i = a_i + b_i c_i; when (max f - mean f) / mean f > ``threshold`` for ``patience`` steps in a row (a layer's
    first not counted: its measurements go at the next), the target is proposed if it moves at least ``min_move``
    kernels and predicts max_i f_i(new) < max_i f_i(current); then
    ``cooldown`` steps measured, not judged. One sitting out gets a kernel back for one step after ``reprobe``
    steps (0: never), twice as long each time it stays slow.
    """

    threshold: float = 0.10
    patience: int = 3
    smoothing: float = 0.3
    cooldown: int = 5
    min_move: int = 1
    window: int = 20
    reprobe: int = 50
    _layers: dict[str, _LayerState] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0 (a fraction of the mean finish time), got {self.threshold!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1] (1 = no memory), got {self.smoothing!r}")
        counts = {
            "patience": (1, "steps"),
            "cooldown": (0, "steps"),
            "min_move": (1, "kernels"),
            "window": (2, "measurements kept per participant"),
            "reprobe": (0, "steps; 0: never"),
        }
        for name, (least, what) in counts.items():
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= least):
                raise ValueError(f"{name} must be an int >= {least} ({what}), got {value!r}")

    def fresh(self) -> Rebalancer:
        """The same settings with nothing remembered: for a new set of participants."""
        return replace(self)  # _layers is not an init field: a new, empty one

    def cost_models(self, layer: str) -> list[tuple[float, float] | None]:
        """Each participant's fitted (a_i seconds, b_i seconds per kernel); None: never measured."""
        if layer not in self._layers:
            return []
        return [fit_affine_cost(s, self.smoothing) for s in self._layers[layer].samples]

    def record(self, layer: str, counts: Sequence[int], times: Sequence[float]) -> None:
        """File ``counts[i]`` kernels in ``times[i]`` seconds for each participant i (none for 0 kernels)
        without judging the plan. Measurements that are not a training step (the calibration's, at F) stand only
        until the first step, and its own until the second (why: docs/how-it-works.md)."""
        state = self._state(layer, counts, times)
        for samples, c, t in zip(state.samples, counts, times, strict=True):
            if c > 0:
                samples.append((int(c), float(t)))

    def observe(self, layer: str, counts: Sequence[int], times: Sequence[float]) -> list[int] | None:
        """Record one step of ``layer`` as :meth:`record` does, then do its phase's row of the phase
        table (docs/how-it-works.md); returns new counts (summing to the same) to use from the next step, or None."""
        state = self._state(layer, counts, times)
        if state.steps < 2:  # the calibration's samples (record), then the first step's (first-use allocations)
            state.samples = [deque(maxlen=self.window) for _ in counts]
        state.steps += 1
        self.record(layer, counts, times)
        for i, c in enumerate(counts):
            state.idle[i] = 0 if c > 0 else state.idle[i] + 1
        if state.steps == 1:  # its measurements go at the next step: no lag is judged on them either
            return None
        if state.phase is Phase.PROBING:
            return self._judge_probe(layer, state, counts)
        if (probe := self._reprobe(state, counts)) is not None:  # due: WATCHING or COOLING alike
            return probe
        if state.phase is Phase.COOLING:  # one step of the cool-down counted off
            state.cooldown_left -= 1
            return None
        return self._watch(layer, state, counts)

    def phase(self, layer: str) -> Phase:
        """Where ``layer`` is between steps (WATCHING before its first)."""
        return self._layers[layer].phase if layer in self._layers else Phase.WATCHING

    def _watch(self, layer: str, state: _LayerState, counts: Sequence[int]) -> list[int] | None:
        """WATCHING: extend or end the streak of lagging steps; at ``patience``, propose the target."""
        models = self._fitted(layer)
        if models is None:
            return None
        finish = [a + b * c for (a, b), c in zip(models, counts, strict=True) if c > 0]
        mean = sum(finish) / len(finish)
        lag = (max(finish) - mean) / mean if mean > 0 else 0.0
        state.late_steps = state.late_steps + 1 if lag > self.threshold else 0
        if state.late_steps < self.patience:
            return None
        state.late_steps = 0
        return self._move(state, models, counts, _target(models, counts))

    def _judge_probe(self, layer: str, state: _LayerState, counts: Sequence[int]) -> list[int] | None:
        """PROBING: judge the step at once (no streak); the probed participant keeps its kernels
        if the target gives it some, else sits out again, for twice as long as before."""
        probed, state.probing = state.probing, None  # back to the phase the probe broke into
        models = self._fitted(layer)
        if models is None:
            return None
        target = _target(models, counts)
        # out again: twice as long before the next try; kept: back to the start
        state.reprobe_in[probed] = 2 * state.reprobe_in[probed] if target[probed] == 0 else self.reprobe
        return self._move(state, models, counts, target)

    def _move(
        self, state: _LayerState, models: list[tuple[float, float]], counts: Sequence[int], target: list[int]
    ) -> list[int] | None:
        """``target`` if it moves at least ``min_move`` kernels and ends the layer sooner; else None."""
        moved = sum(abs(new - old) for new, old in zip(target, counts, strict=True)) // 2
        if moved < self.min_move or _makespan(models, target) >= _makespan(models, counts) * (1 - 1e-9):
            return None
        state.cooldown_left = self.cooldown
        return target

    def _fitted(self, layer: str) -> list[tuple[float, float]] | None:
        """Every participant's cost model; None if one was never measured: nothing to compare."""
        models = self.cost_models(layer)
        if any(m is None for m in models):
            return None
        return [m for m in models if m is not None]

    def _reprobe(self, state: _LayerState, counts: Sequence[int]) -> list[int] | None:
        """One kernel back, from whoever has the most, for the participant longest without any
        once that is ``reprobe_in`` steps or more (the layer goes PROBING); None if nobody is due."""
        if not self.reprobe or sum(counts) < len(counts):  # fewer kernels than participants: some must sit out
            return None
        due = [i for i, c in enumerate(counts) if c == 0 and state.idle[i] >= state.reprobe_in[i]]
        donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
        if not due or counts[donor] < 2:
            return None
        i = max(due, key=lambda j: (state.idle[j], -j))
        probe = list(counts)
        probe[donor] -= 1
        probe[i] = 1
        state.probing = i
        state.late_steps = 0
        return probe

    def _state(self, layer: str, counts: Sequence[int], times: Sequence[float]) -> _LayerState:
        """Check one measurement per participant; this layer's state (created on first use)."""
        if len(counts) != len(times) or len(counts) == 0:
            raise ValueError(f"need one time per participant, got counts {list(counts)} and times {list(times)}")
        for i, (c, t) in enumerate(zip(counts, times, strict=True)):
            if c < 0 or (c > 0 and not (math.isfinite(t) and t >= 0)):
                raise ValueError(f"participant {i}: {c} kernels in {t!r} s is not a measurement")
        if layer not in self._layers:
            self._layers[layer] = _LayerState(
                samples=[deque(maxlen=self.window) for _ in counts],
                idle=[0] * len(counts),
                reprobe_in=[self.reprobe] * len(counts),
            )
        state = self._layers[layer]
        if len(state.samples) != len(counts):
            raise ValueError(
                f"layer {layer!r} had {len(state.samples)} participants, now {len(counts)}; "
                "use a new Rebalancer when the set of participants changes"
            )
        return state


def _target(models: Sequence[tuple[float, float]], counts: Sequence[int]) -> list[int]:
    """The split a proposal aims for: finishing together, whoever can only slow the layer down sitting out.

    Such a participant is held at one kernel, and the layer ends sooner without it: the others split all F
    kernels among themselves (:func:`equal_finish_kernels`) and finish before its one kernel would. Tried
    slowest first (largest a_i + b_i), one at a time.
    """
    total = sum(counts)
    target = _equal_finish_among(models, list(range(len(counts))), total)
    while True:
        active = [i for i, c in enumerate(target) if c > 0]
        held = [i for i in active if target[i] == 1]
        if len(active) < 2 or not held:
            return target
        slowest = max(held, key=lambda i: (models[i][0] + models[i][1], -i))
        without = _equal_finish_among(models, [i for i in active if i != slowest], total)
        if _makespan(models, without) >= _makespan(models, target):
            return target
        target = without


def _equal_finish_among(models: Sequence[tuple[float, float]], who: list[int], total: int) -> list[int]:
    """Whole kernel counts for every participant: the equal-finish split of ``total`` among ``who``
    (:func:`equal_finish_kernels`, rounded by finish time: :func:`whole_by_finish`), 0 for the others."""
    costs = [models[i] for i in who]
    counts = [0] * len(models)
    for i, c in zip(who, whole_by_finish(costs, equal_finish_kernels(costs, total), total), strict=True):
        counts[i] = c
    return counts


def _makespan(models: Sequence[tuple[float, float]], counts: Sequence[int]) -> float:
    """Predicted time of a layer: the latest finish a_i + b_i c_i over participants with kernels."""
    return max(a + b * c for (a, b), c in zip(models, counts, strict=True) if c > 0)
