"""benchmarks/bench_init.py: its candidates change only the classifier, and its per-layer rate is SGD's update.

Tiny networks and random data: the benchmark's comparison is only as good as these two facts.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tinyconv.model import paper_net
from tinyconv.optim import SGD

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


def steps(opt, net, n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    for _ in range(n):
        net.train_step(rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 4))
        opt.step()
    return net.state_dict()


def test_classifier_rate_sgd_is_sgd_with_that_layers_rate_scaled(bench):
    ref_net = paper_net("2:3", "numpy", "lrn", seed=5)
    start = ref_net.state_dict()
    ref = steps(SGD(ref_net, 0.05, 0.9, 5e-4), ref_net)
    same_net = paper_net("2:3", "numpy", "lrn", seed=5)
    same = steps(bench.ClassifierRateSGD(same_net, 0.05, 0.9, 5e-4, 1.0), same_net)
    for key in ref:  # scale 1 is tinyconv.SGD, bit for bit
        np.testing.assert_array_equal(same[key], ref[key], err_msg=key)
    # one step at scale 0.1: the convolutions move as SGD moves them, the classifier a tenth as far
    nets = [paper_net("2:3", "numpy", "lrn", seed=5) for _ in range(2)]
    full = steps(SGD(nets[0], 0.05, 0.9, 5e-4), nets[0], 1)
    tenth = steps(bench.ClassifierRateSGD(nets[1], 0.05, 0.9, 5e-4, 0.1), nets[1], 1)
    for key in full:
        if key.startswith("fc1."):
            np.testing.assert_allclose(tenth[key] - start[key], 0.1 * (full[key] - start[key]), rtol=1e-3, atol=1e-7)
            assert np.any(full[key] != start[key])
        else:
            np.testing.assert_array_equal(tenth[key], full[key], err_msg=key)


def test_bad_rates_and_candidates_are_refused_with_the_choices(bench):
    assert bench.parse_lrs("0.01, 0.02") == [0.01, 0.02]
    with pytest.raises(argparse.ArgumentTypeError, match="positive learning rates"):
        bench.parse_lrs("0.01,-1")
    with pytest.raises(argparse.ArgumentTypeError, match="separated by commas"):
        bench.parse_lrs("0.01;0.02")
    with pytest.raises(argparse.ArgumentTypeError, match="choose from default, zero, scaled, fc-rate"):
        bench.parse_candidates("default,ones")
