"""The learning-rate schedule's warm-up: a fraction of the run's planned steps, whatever its length."""

from __future__ import annotations

import math

import pytest

from tinyconv.data import synthetic_dataset
from tinyconv.model import paper_net
from tinyconv.schedule import SCHEDULES, learning_rate, warmup_steps
from tinyconv.trainer import TrainConfig, Trainer, planned_steps

CIFAR_TRAIN = 50_000  # CIFAR-10's training images: 781 steps of 64 an epoch


def test_a_steps_run_warms_up_for_its_fraction_not_an_epoch():
    assert planned_steps(CIFAR_TRAIN, TrainConfig(max_steps=400)) == (781, 400, 20)
    assert planned_steps(CIFAR_TRAIN, TrainConfig(max_steps=400, warmup=0.1)) == (781, 400, 40)


def test_a_full_run_warms_up_for_the_same_fraction():
    assert planned_steps(CIFAR_TRAIN, TrainConfig()) == (781, 7810, int(0.05 * 7810))
    assert planned_steps(CIFAR_TRAIN, TrainConfig(epochs=12, batch_size=128, warmup=0.25)) == (390, 4680, 1170)


def test_warmup_epochs_still_mean_whole_epochs():
    assert planned_steps(CIFAR_TRAIN, TrainConfig(max_steps=400, warmup_epochs=1)) == (781, 400, 781)
    assert planned_steps(CIFAR_TRAIN, TrainConfig(warmup_epochs=0.5)) == (781, 7810, 390)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_rate_reaches_its_peak_at_the_end_of_the_warmup(schedule):
    total, base = 400, 0.1
    w = warmup_steps(total, 0.05)
    lrs = [learning_rate(s, total, base, schedule, w) for s in range(total)]
    assert lrs[:w] == pytest.approx([base * (s + 1) / w for s in range(w)])  # a straight ramp from 0 ...
    assert lrs[w - 1] == pytest.approx(base) and lrs[w] == pytest.approx(base)  # ... to the peak, kept a step
    assert max(lrs) == pytest.approx(base)


def test_the_step_schedule_decays_at_fractions_of_the_run_after_the_warmup():
    total, w, base = 120, 20, 1.0  # 100 steps after the warm-up: decays at steps 20 + 50 and 20 + 75
    lrs = [learning_rate(s, total, base, "step", w) for s in range(total)]
    assert (lrs[69], lrs[70], lrs[94], lrs[95]) == pytest.approx((1.0, 0.1, 0.1, 0.01))


def test_cosine_ends_near_zero_whatever_the_warmup():
    for w in (0, 20, 60):
        assert learning_rate(119, 120, 1.0, "cosine", w) < 0.01


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_a_bad_fraction_is_a_clear_error_naming_the_flag(bad):
    with pytest.raises(ValueError, match=r"--warmup\) must be a fraction of the run in \[0, 1\)"):
        warmup_steps(100, bad)
    data = synthetic_dataset(n_train=64, n_test=8)
    with pytest.raises(ValueError, match="--warmup"):
        Trainer(paper_net("4:8", "numpy", "lrn"), data, TrainConfig(batch_size=32, warmup=bad, progress=False))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_warmup_epochs_are_a_clear_error_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--warmup-epochs must be a number >= 0"):
        planned_steps(64, TrainConfig(batch_size=32, warmup_epochs=bad))
