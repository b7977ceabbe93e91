"""The master's spot checks of a worker's results: honest ones pass, wrong ones lose the worker, within budget."""

from __future__ import annotations

import numpy as np
import pytest

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import spot_check
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.spot_check import SpotCheck
from tinyconv.distributed.worker.handler import Worker
from transports.base import Message

BE = NumpyBackend()
TAIL = [
    {"op": "relu"},
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0},
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
]


class Steps:
    """A worker's block tasks, step after step (N images, C channels, F' kernels of which it owns [2, F'-2)),
    answered by a real worker and then, maybe, spoilt by ``spoil(name, array, step)``."""

    def __init__(self, n: int = 8, c: int = 3, f: int = 12, hw: int = 10, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.n, self.c, self.f, self.hw = n, c, f, hw
        self.worker = Worker(BE)
        self.task = 0

    def _send(self, kind: str, header: dict, arrays: dict, step: int) -> tuple[Message, Message]:
        self.task += 1
        msg = Message(kind, {**header, "task": self.task, "step": step, "layer": 0}, arrays)
        reply = self.worker.handle(msg)
        assert reply.kind == "result", reply.header
        return msg, reply

    def run(self, spot: SpotCheck, steps: int, spoil=lambda name, a, step: a) -> int:
        """Steps until the spot check loses the worker (its step), or ``steps`` + 1 if it never does."""
        for step in range(1, steps + 1):
            x = self.rng.standard_normal((self.n, self.c, self.hw, self.hw), dtype=np.float32)
            w = self.rng.standard_normal((self.f, self.c, 5, 5), dtype=np.float32) * 0.2
            b = self.rng.standard_normal(self.f, dtype=np.float32) * 0.1
            own = [2, self.f - 2]
            header = {"stride": 1, "padding": 2, "tail": TAIL, "own": own}
            fwd, y = self._send("block_forward", header, {"x": x, "w": w, "b": b}, step)
            y.arrays = {k: spoil(k, a, step) for k, a in y.arrays.items()}
            dy = self.rng.standard_normal((self.n, self.f, 5, 5), dtype=np.float32)
            bwd, grads = self._send("block_backward", {"need_dx": True}, {"dy": dy}, step)
            grads.arrays = {k: spoil(k, a, step) for k, a in grads.arrays.items()}
            try:
                spot(7, fwd, y, BE)
                spot(7, bwd, grads, BE)
            except Lost as e:
                assert list(e.workers) == [7] and e.workers[7].startswith("wrong result: "), e.workers
                return step
        return steps + 1


def test_honest_results_pass_even_off_by_round_off():
    """A worker whose every number is a few ulps off (another BLAS, another device) is never lost."""
    rng = np.random.default_rng(1)

    def ulps(name, a, step):
        return (a * (1 + rng.uniform(-8, 8, a.shape) * 2.0**-24)).astype(np.float32)

    spot = SpotCheck(budget=1.0)  # samples every step: the most chances of a false alarm
    assert Steps().run(spot, 40, ulps) == 41
    assert spot.samples >= 40


@pytest.mark.parametrize("factor", [-50.0, 1.01])
def test_results_scaled_are_caught_at_the_first_step(factor):
    """x -50 poison and a 1 % perturbation of every result both fail the first step's sample."""
    assert Steps().run(SpotCheck(), 5, lambda name, a, step: a * np.float32(factor)) == 1


def test_a_wrong_backward_alone_is_caught():
    """A worker whose forward is right but whose dw is 1 % off is caught by a kernel sample within the budget."""

    def spoil(name, a, step):
        return a * np.float32(1.01) if name == "dw" else a

    lost_at = Steps(n=32, f=40).run(SpotCheck(budget=0.03, seed=3), 60, spoil)
    assert lost_at <= 20


def test_a_backward_sample_that_disagrees_is_confirmed_on_two_more_images():
    """Round-off may flip a tie (max pool's argmax) in an image's backward: a disagreement is taken again on up
    to two more images, so two images off of three forgive the worker, while the fault in every image loses it."""
    spot = SpotCheck(budget=1.0, seed=5)

    def two_images(name, a, step):
        return a + np.eye(2, len(a), dtype=np.float32).sum(0).reshape(-1, 1, 1, 1) if name == "dx" else a

    assert Steps(n=3).run(spot, 12, two_images) == 13
    assert spot.forgiven >= 1  # it did sample image 0 or 1, and forgave it

    def every_image(name, a, step):
        return a + np.float32(1.0) if name == "dx" else a

    assert Steps(n=3).run(SpotCheck(budget=1.0), 3, every_image) == 1


def test_the_budget_holds_and_is_spent(monkeypatch):
    """The samples' seconds stay within the budget of the worker's work at the master's rate, but for one sample
    of each kind ahead; and the budget is spent, not hoarded. A fake clock makes every sample cost the same."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(spot_check.time, "perf_counter", lambda: float(next(ticks)))
    spot = SpotCheck(budget=0.03)
    Steps(n=16, f=24).run(spot, 200)
    # each sample reads the clock twice forward and twice backward: 1 s forward + 1 s backward
    credit = spot.workers[7].credit
    assert spot.seconds - spot.earned == pytest.approx(-sum(credit.values()))
    assert all(c >= -2 for c in credit.values())  # at most one sample ahead of the budget
    assert spot.earned - spot.seconds < 2 * 2  # and at most one behind: what it earns, it spends
    assert spot.samples > 10


def test_the_budget_must_be_a_fraction():
    with pytest.raises(ValueError, match="fraction of each worker's work"):
        SpotCheck(budget=0.0)
