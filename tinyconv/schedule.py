"""Learning-rate schedules: a pure function of the global step, so resuming is trivial."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "step", "cosine")


def learning_rate(
    step: int, total_steps: int, base_lr: float, schedule: str = "cosine", warmup_steps: int = 0
) -> float:
    """The learning rate for 0-based ``step`` of ``total_steps``.

    constant: base_lr.
    step:     base_lr, divided by 10 at 50% and again at 75% of training.
    cosine:   base_lr * (1 + cos(pi * progress)) / 2, decaying to 0 at the end.
    All three ramp up linearly over the first ``warmup_steps`` steps.
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
