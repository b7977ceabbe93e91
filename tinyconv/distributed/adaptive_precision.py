"""Which wire format each array of a layer travels in: fixed (``--wire-precision bf16``), or AWP's.

A layer's arrays play three roles (:data:`ROLES`, by ``protocol.py``'s names): weights, maps, gradients.
A fixed setting sends all three in one format. ``adaptive`` is AWP, the Adaptive Weight Precision of Zhuang,
Malossi and Casas (2020): each layer's weights widen bf16 -> adt24 -> fp32 as their L2 norm settles, the maps
go in s8 (most of the bytes, and their rounding never accumulates) and the gradients in bf16. The rule, its
numbers and why: docs/how-it-works.md, "adaptive: AWP".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyconv.distributed.wire_precision import FORMATS, RELATIVE_ERROR

ROLES: dict[str, tuple[str, ...]] = {
    "weights": ("w", "b"),
    "maps": ("x", "y", "p_lo", "p_hi", "sum"),
    "grads": ("dy", "dyc", "dyc_lo", "dyc_hi", "dx", "dw", "db"),
}
# --wire-precision: every fixed format of wire_precision.py, then AWP; the main job, tinyconv comm, simulate and
# the grid take their choices from here
SETTINGS = (*FORMATS, "adaptive")


def formats_of(roles: dict[str, str]) -> dict[str, str]:
    """role -> format, as array name -> format (what :class:`~tinyconv.distributed.wire_codec.Narrowing` takes)."""
    return {name: roles[role] for role, names in ROLES.items() for name in names}


@dataclass
class _Layer:
    rung: int = 0
    norm: float | None = None  # at the last check
    checked: int = 0  # the step of the last check


@dataclass
class AdaptivePrecision:
    """AWP: every ``interval`` steps, r = | ||W_t|| - ||W_{t - interval}|| | / ||W_{t - interval}||, the
    relative change of a layer's weights' L2 norm; r < ``thresholds[rung]`` widens its weights one rung of
    ``ladder`` from the next step, never back. A fixed setting is a ladder of one rung (:func:`policy`)."""

    interval: int = 20
    thresholds: tuple[float, ...] = (2 * RELATIVE_ERROR["bf16"], 2 * RELATIVE_ERROR["adt24"])
    ladder: tuple[str, ...] = ("bf16", "adt24", "fp32")
    maps: str = "s8"
    grads: str = "bf16"
    layers: dict[str, _Layer] = field(default_factory=dict)

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


def policy(setting: str) -> AdaptivePrecision:
    """The policy ``--wire-precision setting`` names."""
    if setting == "adaptive":
        return AdaptivePrecision()
    if setting not in SETTINGS:
        raise ValueError(f"--wire-precision must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return AdaptivePrecision(thresholds=(), ladder=(setting,), maps=setting, grads=setting)
