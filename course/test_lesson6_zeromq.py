"""Grades lesson 6's arithmetic on hand-made step records."""

from __future__ import annotations

import pytest

LESSON = "06_zeromq_workers"


def test_split_fractions(lesson):
    got = lesson.split_fractions({"event": "step", "time_s": 2.1, "comm_s": 0.5, "conv_s": 1.0, "comp_s": 0.5})
    assert got.keys() == {"comm", "conv", "comp"}
    assert got == pytest.approx({"comm": 0.25, "conv": 0.5, "comp": 0.25}, rel=1e-12)


def test_split_fractions_alone(lesson):
    assert lesson.split_fractions({"comm_s": 0.0, "conv_s": 0.0, "comp_s": 0.3}) == pytest.approx(
        {"comm": 0.0, "conv": 0.0, "comp": 1.0}
    )


@pytest.mark.parametrize(
    "args,want", [((5_000_000, 5.0), 1.0), ((20_000_000, 100.0, 0.002, 8), 0.216), ((0, 5.0, 0.01, 3), 0.03)]
)
def test_link_seconds(lesson, args, want):
    assert lesson.link_seconds(*args) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("times,want", [([1.0, 1.0, 1.0], 0.0), ([1.0, 2.0, 3.0], 0.5), ([0.0, 2.0, 4.0], 1 / 3)])
def test_imbalance(lesson, times, want):
    assert lesson.imbalance(times) == pytest.approx(want, rel=1e-12)
