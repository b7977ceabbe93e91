"""Presets by name (tinyconv/presets.py) in the main job: what each sets, what wins over it, what it says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tinyconv.commands import train, train_checks
from tinyconv.presets import DEFAULT_PRESET, PRESETS

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cifar10_dist.py"
SETTINGS = ("arch", "norm", "epochs", "batch_size", "lr", "schedule", "warmup", "weight_decay", "classifier_lr")


@pytest.fixture(scope="module")
def example():
    """The main job's entry point, tinyconv/commands/train.py (examples/cifar10_dist.py and `tinyconv train` run it)."""
    return train


def parsed(example, *argv: str):
    args = example.build_parser().parse_args(list(argv))
    train_checks.apply_preset(args)
    return args


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_sets_its_whole_recipe(example, name):
    args = parsed(example, "--preset", name)
    assert {k: getattr(args, k) for k in SETTINGS} == PRESETS[name].settings()
    assert args.changed == [] and args.warmup_epochs is None


def test_no_preset_is_the_quick_preset_and_best_and_paper_are_by_name(example):
    args = parsed(example)  # a newcomer's first run: >= 75 % in about 16 minutes (#39)
    assert args.preset == DEFAULT_PRESET == "quick"
    quick = {"arch": "48:96", "norm": "batch", "epochs": 7, "batch_size": 128, "lr": 0.05, "schedule": "cosine"}
    assert {k: getattr(args, k) for k in quick} == quick and args.weight_decay == 5e-4
    args = parsed(example, "--preset", "best")
    best = {"arch": "64:128", "norm": "batch", "epochs": 30, "batch_size": 128, "lr": 0.05, "schedule": "cosine"}
    assert {k: getattr(args, k) for k in best} == best
    assert example.train_config(args).classifier_lr == 0.1  # the 8,192-wide classifier: benchmarks/bench_recipe.py
    assert example.train_config(parsed(example, "--classifier-lr", "1")).classifier_lr == 1.0
    assert "(default quick;" in " ".join(example.build_parser().format_help().split())
    paper = parsed(example, "--preset", "paper")
    today = {"arch": "50:500", "norm": "lrn", "epochs": 10, "batch_size": 64, "lr": 0.01, "schedule": "cosine"}
    assert {k: getattr(paper, k) for k in today} == today and example.train_config(paper).classifier_lr == 0.1


def test_options_given_beside_a_preset_win_and_are_named(example):
    args = parsed(example, "--preset", "quick", "--epochs", "3", "--lr", "0.02", "--norm", "lrn", "--steps", "7")
    quick = PRESETS["quick"]
    assert (args.epochs, args.lr, args.norm) == (3, 0.02, "lrn")
    assert (args.arch, args.batch_size, args.warmup) == (quick.arch, quick.batch_size, quick.warmup)
    assert args.changed == ["--norm lrn", "--epochs 3", "--lr 0.02", "--steps 7"]
    # the same value as the preset's is no change; --warmup-epochs replaces the preset's fraction
    args = parsed(example, "--preset", "quick", "--epochs", str(quick.epochs), "--warmup-epochs", "1")
    assert args.changed == ["--warmup-epochs 1"]
    assert example.train_config(args).warmup_epochs == 1.0


def test_label_smoothing_is_named_as_a_change_and_trains_with_every_parallelism(example, capsys):
    args = parsed(example, "--preset", "quick", "--label-smoothing", "0.1")
    assert args.changed == ["--label-smoothing 0.1"] and example.train_config(args).label_smoothing == 0.1
    line = example.plan_line(args, (48, 96), 50_000)
    assert (
        "lr 0.05 (the classifier's 0.1x) cosine, label smoothing 0.1 (preset quick); no expected accuracy: this "
        "run changes preset quick (--label-smoothing 0.1)" in line
    )
    assert parsed(example).changed == [] and example.train_config(parsed(example)).label_smoothing == 0.0
    for parallel in ("data", "hybrid"):  # the replicas' slices, or the master's classifier, smooth the loss
        argv = ["--dataset", "synthetic", "--arch", "4:8", "--batch-size", "16", "--parallel", parallel,
                "--label-smoothing", "0.1", "--steps", "1", "--no-progress"]  # fmt: skip
        assert example.main(argv) == 0
        out, err = capsys.readouterr()
        assert "label smoothing 0.1" in out and "Error" not in err


def test_an_unknown_preset_is_refused_with_the_choices(example, capsys):
    assert example.main(["--preset", "fast", "--dataset", "synthetic"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "argument --preset: invalid choice: 'fast'" in err
    assert all(name in err for name in PRESETS)


def test_no_preset_claims_a_figure_nobody_measured():
    for p in PRESETS.values():
        assert (p.expected_accuracy is None and p.expected_minutes is None) or p.measured_by, p.name
        assert 0 <= p.warmup < 1 and p.about


def test_the_expectation_in_words():
    paper = dataclasses.replace(PRESETS["paper"], expected_accuracy=None, expected_minutes=None, measured_by=None)
    assert paper.expectation() == "expected accuracy and time: not measured yet"
    measured = dataclasses.replace(paper, expected_accuracy=0.758, expected_minutes=93, measured_by="a command")
    assert measured.expectation() == "expected test accuracy 75.8%, wall time on 2 cores about 93 min"
    half = dataclasses.replace(paper, expected_accuracy=0.758, measured_by="a command")
    assert half.expectation() == "expected test accuracy 75.8%, wall time on 2 cores not measured yet"


def test_the_startup_line_for_a_full_run_and_a_steps_run(example):
    args = parsed(example, "--preset", "quick")
    assert example.plan_line(args, (48, 96), 50_000) == (
        "plan: 48:96 network with batch norm, 7 epochs (2,730 steps of batch 128, the first 136 a warm-up), "
        "lr 0.05 (the classifier's 0.1x) cosine (preset quick); expected test accuracy 77.0%, wall time on 2 cores "
        "about 16 min"
    )
    args = parsed(example, "--preset", "paper", "--steps", "400")
    assert example.plan_line(args, (50, 500), 50_000) == (
        "plan: 50:500 network with LRN, 1 epoch (400 steps of batch 64, the first 20 a warm-up), "
        "lr 0.01 (the classifier's 0.1x) cosine (preset paper); no expected accuracy: this run changes preset paper "
        "(--steps 400)"
    )
    args = parsed(example, "--preset", "quick", "--dataset", "synthetic")  # the figures are CIFAR-10's
    assert example.plan_line(args, (48, 96), 50_000).endswith(
        "no expected accuracy: synthetic data (preset quick's figures are for CIFAR-10)"
    )


def test_the_main_job_starts_with_the_plan_and_ends_with_the_test_accuracy(example, capsys):
    argv = ["--preset", "quick", "--arch", "4:8", "--steps", "3", "--workers", "0", "--dataset", "synthetic"]
    assert example.main([*argv, "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan: "))
    assert lines[plan] == (
        "plan: 4:8 network with batch norm, 1 epoch (3 steps of batch 128, no warm-up), lr 0.05 (the "
        "classifier's 0.1x) cosine (preset quick); no expected accuracy: synthetic data (preset quick's figures "
        "are for CIFAR-10)"
    )
    assert all("loading" in line or "images" in line for line in lines[:plan])  # before the network, the workers
    assert lines[-1].startswith("test accuracy ") and " after 3 steps, " in lines[-1]
    assert lines[-1].endswith("(no expected accuracy: synthetic data (preset quick's figures are for CIFAR-10))")
