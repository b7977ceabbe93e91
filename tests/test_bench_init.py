"""benchmarks/bench_init.py: its candidates change only the classifier (its per-layer rate is SGD's, test_training.py).

Tiny networks and random data: the benchmark's comparison is only as good as these two facts.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tinyconv.model import paper_net

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_init.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_init", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"arch": "2:3", "norm": "lrn", "seed": 5, "scale": 0.1, **kw})


def test_candidates_change_only_the_classifier(bench):
    today = paper_net("2:3", "numpy", "lrn", seed=5).state_dict()
    for candidate, factor in (("default", 1.0), ("zero", 0.0), ("scaled", 0.1), ("fc-rate", 1.0)):
        state = bench.build(args(), candidate).state_dict()
        assert state.keys() == today.keys()
        for key in today:
            if key == "fc1.w":
                np.testing.assert_array_equal(state[key], today[key] * np.float32(factor), err_msg=candidate)
            else:  # the convolutions and every bias: bit for bit today's
                np.testing.assert_array_equal(state[key], today[key], err_msg=f"{candidate} {key}")
    assert np.any(today["fc1.w"] != 0)


def test_bad_rates_and_candidates_are_refused_with_the_choices(bench):
    from tinyconv.options import UsageError

    parser = bench.build_parser()
    args = parser.parse_args(["--lrs", "0.01", "0.02", "--candidates", "zero", "fc-rate", "--batch-size", "32"])
    assert (args.lrs, args.candidates, args.batch_size, args.steps) == ([0.01, 0.02], ["zero", "fc-rate"], 32, 80)
    with pytest.raises(UsageError, match="--lrs: must be a number > 0"):
        parser.parse_args(["--lrs", "0.01", "-1"])
    with pytest.raises(UsageError, match="must be one of default, zero, scaled, fc-rate"):
        parser.parse_args(["--candidates", "default", "ones"])
    with pytest.raises(UsageError, match="--batch is now --batch-size"):
        parser.parse_args(["--batch", "32"])
    with pytest.raises(UsageError, match="--steps: must be 40 or more"):
        parser.parse_args(["--steps", "39"])
