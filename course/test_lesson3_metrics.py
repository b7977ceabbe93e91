"""Grades lesson 3's metrics readers on a small metrics file written here, with known answers."""

from __future__ import annotations

import json

import pytest

LESSON = "03_training"


def step(epoch: int, step: int, loss: float, acc: float, time_s: float, comm_s: float, conv_s: float, comp_s: float):
    return {
        "event": "step",
        "epoch": epoch,
        "step": step,
        "loss": loss,
        "acc": acc,
        "time_s": time_s,
        "comm_s": comm_s,
        "conv_s": conv_s,
        "comp_s": comp_s,
    }


EVENTS = [
    {"event": "run", "seed": 0, "arch": {"arch": "8:16"}},
    step(1, 1, 2.4, 0.1, 9.0, 0.0, 0.0, 9.0),
    step(1, 2, 2.2, 0.2, 0.5, 0.1, 0.3, 0.1),
    step(1, 3, 2.0, 0.3, 0.7, 0.2, 0.2, 0.3),
    {"event": "future_event", "step": 3, "anything": [1, 2]},
    {"event": "epoch", "epoch": 1, "steps": 3, "complete": True, "test_acc": 0.35, "test_loss": 1.9},
    step(2, 4, 1.5, 0.5, 0.6, 0.3, 0.1, 0.2),
    step(2, 5, 1.4, 0.6, 0.4, 0.05, 0.25, 0.1),
    {"event": "epoch", "epoch": 2, "steps": 5, "complete": True, "test_acc": 0.62, "test_loss": 1.2},
    {"event": "epoch", "epoch": 3, "steps": 6, "complete": False, "test_acc": 0.6, "test_loss": 1.3},
    {"event": "summary", "steps": 6, "test_acc": 0.6},
]


@pytest.fixture
def metrics_file(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" + ("\n" if i == 4 else "") for i, e in enumerate(EVENTS)))
    return path


def test_read_events(lesson, metrics_file):
    assert list(lesson.read_events(metrics_file)) == EVENTS


def test_read_events_takes_a_string_path(lesson, metrics_file):
    assert len(lesson.read_events(str(metrics_file))) == len(EVENTS)


def test_test_accuracy_curve(lesson):
    assert [tuple(p) for p in lesson.test_accuracy_curve(EVENTS)] == [(3, 0.35), (5, 0.62), (6, 0.6)]


def test_median_split_skips_the_first_steps(lesson):
    got = lesson.median_split(EVENTS)  # steps 2..5
    want = {"time_s": 0.55, "comm_s": 0.15, "conv_s": 0.225, "comp_s": 0.15}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-12 for k in want), got
    assert abs(lesson.median_split(EVENTS, skip=0)["time_s"] - 0.6) < 1e-12


def test_steps_to_reach(lesson):
    assert lesson.steps_to_reach(EVENTS, 0.3) == 3
    assert lesson.steps_to_reach(EVENTS, 0.6) == 5
    assert lesson.steps_to_reach(EVENTS, 0.9) is None
