"""Learning-rate schedules: a pure function of the global step, so resuming is trivial."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "step", "cosine")


def warmup_steps(total_steps: int, fraction: float) -> int:
    """The warm-up's length: ``fraction`` (in [0, 1)) of the run's planned steps, rounded down. A fraction, not
    epochs, so a short run warms up in proportion: one epoch's left a 400-step run below its peak rate."""
    if not 0 <= fraction < 1:  # NaN fails this too
        raise ValueError(f"the warm-up (--warmup) must be a fraction of the run in [0, 1), got {fraction}")
    return int(fraction * total_steps)


def learning_rate(
    step: int, total_steps: int, base_lr: float, schedule: str = "cosine", warmup_steps: int = 0
) -> float:
    """The learning rate for 0-based ``step`` of ``total_steps``.

    All three ramp up linearly over the first ``warmup_steps`` steps, reaching ``base_lr`` at the
    warm-up's last step. After it, ``progress`` runs from 0 to 1 over the *remaining* steps
    (``total_steps - warmup_steps``), and the schedules are functions of that progress:

    constant: base_lr.
    step:     base_lr, divided by 10 at 50% and again at 75% of the post-warm-up run.
    cosine:   base_lr * (1 + cos(pi * progress)) / 2, decaying to 0 at the end.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "step":
        return base_lr * (0.1 ** (int(progress >= 0.5) + int(progress >= 0.75)))
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
