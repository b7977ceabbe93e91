"""A training run's settings (:class:`TrainConfig`) and the steps they plan (:func:`planned_steps`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinyconv.schedule import warmup_steps


@dataclass
class TrainConfig:
    """What :class:`~tinyconv.trainer.Trainer` trains with: the schedule, the data, checkpoints, progress."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    classifier_lr: float = 1.0  # a factor on the rate of the network's last layer (why: tinyconv/optim.py)
    # the training loss's target (1 - eps) onehot + eps / K (layers.SoftmaxCrossEntropy), whatever the
    # parallelism (each runtime's train_batch takes it); the test loss stays the plain cross-entropy
    label_smoothing: float = 0.0
    schedule: str = "cosine"
    # Warm-up as a fraction of the planned steps: 5 % ramps a 10-epoch run for half an epoch and a 400-step
    # run for 20 steps; large-batch SGD recipes (Goyal et al. 2017: 5 of 90 epochs) ramp for about as long.
    warmup: float = 0.05
    warmup_epochs: float | None = None  # instead of ``warmup``: this many epochs, whatever the run's length
    max_steps: int | None = None  # stop after this many steps in total (smoke runs)
    augment: bool = True
    prefetch: int = 2  # batches made ahead on a thread while a step computes; 0: each made in its step
    # 0: the training batch's size, which reuses the memory its steps freed (tinyconv/distributed/heap.py)
    # and, distributed, runs the shapes the split was timed on
    eval_batch_size: int = 0
    seed: int = 0
    checkpoint: str | None = None  # written at each epoch end, at the stop, and on the way out
    checkpoint_every: int | None = None  # also every this many steps
    checkpoint_minutes: float | None = None  # also when this long has passed since the last one
    progress: bool = True


def planned_steps(n_train: int, config: TrainConfig) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warm-up steps) of a run over ``n_train`` images: the total after
    ``max_steps``, the warm-up a fraction of that total (or ``warmup_epochs`` whole epochs)."""
    per_epoch = n_train // config.batch_size
    if per_epoch == 0:
        raise ValueError(f"batch size {config.batch_size} is larger than the {n_train} training images")
    total = per_epoch * config.epochs
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    if config.warmup_epochs is None:
        return per_epoch, total, warmup_steps(total, config.warmup)
    if not (math.isfinite(config.warmup_epochs) and config.warmup_epochs >= 0):
        raise ValueError(f"--warmup-epochs must be a number >= 0, got {config.warmup_epochs}")
    return per_epoch, total, int(config.warmup_epochs * per_epoch)
