"""Which wire format each array of a layer travels in: fixed (``--wire-precision bf16``), or AWP's.

A layer's arrays play three roles (the names are ``protocol.py``'s)::

    weights   w, b                               the master's parameters, sent every step
    maps      x, y, p_lo, p_hi, sum              input and output feature maps (forward)
    grads     dy, dyc, dyc_lo, dyc_hi, dx, dw, db  gradients of the maps and of the weights (backward)

A fixed setting sends all three in one format. ``adaptive`` is AWP, the Adaptive Weight Precision
of Zhuang, Malossi and Casas (*Reducing Data Motion to Accelerate the Training of Deep Neural
Networks*, 2020): each layer's weights' precision follows how fast they still change, measured by
their L2 norm every ``interval`` steps::

    r = | ||W_t|| - ||W_{t - interval}|| | / ||W_{t - interval}||        the norm's relative change
    if r < threshold[rung]:  rung += 1                               a finer word, from the next step

on the ladder bf16 (2 bytes) -> adt24 (3) -> fp32 (4), starting at bf16; the rung never goes down.
Early on each step moves a weight by far more than bf16's rounding, so a worker's rounded copy
loses nothing that matters; once the steps get small, a copy rounded to 2^-8 no longer sees them,
and the word must widen. The rule is AWP as we recall it (only the paper's abstract was found);
the numbers are ours: a rung widens when the norm moves less than twice its word's rounding bound
per interval (2^-7 for bf16, 2^-15 for adt24); 20 steps is ~2 % of a CIFAR-10 epoch at batch 50.

Maps go in s8 (``wire_precision.py``): they are ~95 % of the bytes (50:500 at batch 64, split by
kernels), and a map's rounding perturbs only this step's forward, never accumulates as a weight's
does across steps. Gradients stay bf16: their range is float32's (fp16 flushes small values to
zero), and dW is summed into the weights step after step, where s8's absolute error would
accumulate like a weight's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyconv.distributed.wire_precision import FORMATS, RELATIVE_ERROR, check_format

ROLES: dict[str, tuple[str, ...]] = {
    "weights": ("w", "b"),
    "maps": ("x", "y", "p_lo", "p_hi", "sum"),
    "grads": ("dy", "dyc", "dyc_lo", "dyc_hi", "dx", "dw", "db"),
}
# --wire-precision: every fixed format of wire_precision.py, then AWP; the main job, tinyconv comm, simulate and
# the grid take their choices from here
SETTINGS = ("fp32", "bf16", "fp16", "adt24", "s8", "adaptive")
assert set(SETTINGS) == {*FORMATS, "adaptive"}, "a format of wire_precision.py is missing from SETTINGS"


def formats_of(roles: dict[str, str]) -> dict[str, str]:
    """role -> format, as array name -> format (what :class:`~tinyconv.distributed.wire_codec.Narrowing` takes)."""
    return {name: roles[role] for role, names in ROLES.items() for name in names}


class FixedPrecision:
    """Every array of every layer in one format."""

    def __init__(self, fmt: str) -> None:
        self.fmt = check_format(fmt)

    def roles(self, layer: str) -> dict[str, str]:
        """role -> format for ``layer``'s arrays."""
        return dict.fromkeys(ROLES, self.fmt)

    def observe(self, step: int, layer: str, weights: np.ndarray) -> None:
        """Nothing to learn."""


@dataclass
class _Layer:
    rung: int = 0
    norm: float | None = None  # at the last check
    checked: int = 0  # the step of the last check


@dataclass
class AdaptivePrecision:
    """AWP: each layer's weights widen bf16 -> adt24 -> fp32 as their L2 norm settles (see above);
    the maps travel in s8 and the gradients in bf16 throughout.

    ``thresholds[i]``: the relative change per ``interval`` steps below which rung i widens.
    """

    interval: int = 20
    thresholds: tuple[float, ...] = (2 * RELATIVE_ERROR["bf16"], 2 * RELATIVE_ERROR["adt24"])
    ladder: tuple[str, ...] = ("bf16", "adt24", "fp32")
    maps: str = "s8"
    grads: str = "bf16"
    layers: dict[str, _Layer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"interval must be an int >= 1 (steps between checks), got {self.interval!r}")
        if len(self.thresholds) != len(self.ladder) - 1 or not all(t > 0 for t in self.thresholds):
            raise ValueError(f"need one threshold > 0 per step of the ladder {self.ladder}, got {self.thresholds}")
        for fmt in (*self.ladder, self.maps, self.grads):
            check_format(fmt)

    def roles(self, layer: str) -> dict[str, str]:
        """role -> format for ``layer``'s arrays now."""
        rung = self.layers.get(layer, _Layer()).rung
        return {"weights": self.ladder[rung], "maps": self.maps, "grads": self.grads}

    def observe(self, step: int, layer: str, weights: np.ndarray) -> None:
        """After training step ``step`` (from 1), ``layer``'s weights: every ``interval`` steps, the rule."""
        state = self.layers.setdefault(layer, _Layer())
        if state.norm is not None and step - state.checked < self.interval:
            return
        norm = float(np.linalg.norm(np.asarray(weights, dtype=np.float64)))
        if state.norm is not None and state.norm > 0 and state.rung < len(self.thresholds):
            if abs(norm - state.norm) / state.norm < self.thresholds[state.rung]:
                state.rung += 1
        state.norm, state.checked = norm, step


def policy(setting: str) -> FixedPrecision | AdaptivePrecision:
    """The policy ``--wire-precision setting`` names."""
    if setting == "adaptive":
        return AdaptivePrecision()
    if setting not in SETTINGS:
        raise ValueError(f"--wire-precision must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return FixedPrecision(setting)
