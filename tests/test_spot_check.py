"""The master's spot checks of a worker's results: honest ones pass, wrong ones lose the worker, within budget."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from backends.conformance.checks import float32_tolerance
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import spot_check, spot_place, spot_sample
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.replica import free_checks
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.spot_check import SpotCheck
from tinyconv.distributed.worker.handler import Worker
from tinyconv.model import paper_net
from tinyconv.parallel import forward_backward
from transports.base import Message
from transports.inproc import InprocTransport

BE = NumpyBackend()
TAIL = [
    {"op": "relu"},
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0},
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
]


class Steps:
    """A worker's block tasks, step after step (N images, C channels, F' kernels of which it owns [2, F'-2)),
    answered by a real worker and then, maybe, spoilt by ``spoil(name, array, step)``."""

    def __init__(self, n: int = 8, c: int = 3, f: int = 12, hw: int = 10, seed: int = 0, tail=TAIL, same=False) -> None:
        self.rng, self.seed, self.same = np.random.default_rng(seed), seed, same  # same: each step's arrays alike
        self.n, self.c, self.f, self.hw, self.tail = n, c, f, hw, tail
        self.worker = Worker(BE)
        self.task = 0

    def _send(self, kind: str, header: dict, arrays: dict, step: int) -> tuple[Message, Message]:
        self.task += 1
        msg = Message(kind, {**header, "task": self.task, "step": step, "layer": 0}, arrays)
        msg.arrays |= self.spot.ask(7, msg)  # its probe, as the runtime's Op.send asks for it
        reply = self.worker.handle(msg)
        assert reply.kind == "result", reply.header
        return msg, reply

    def run(self, spot: SpotCheck, steps: int, spoil=lambda name, a, step: a) -> int:
        """Steps until the spot check loses the worker (its step), or ``steps`` + 1 if it never does."""
        self.spot = spot
        for step in range(1, steps + 1):
            self.rng = np.random.default_rng(self.seed) if self.same else self.rng  # a gradient that turns slowly
            x = self.rng.standard_normal((self.n, self.c, self.hw, self.hw), dtype=np.float32)
            w = self.rng.standard_normal((self.f, self.c, 5, 5), dtype=np.float32) * 0.2
            b = self.rng.standard_normal(self.f, dtype=np.float32) * 0.1
            own = [2, self.f - 2]
            header = {"stride": 1, "padding": 2, "tail": self.tail, "own": own}
            norm = {"gamma": self.rng.uniform(0.5, 2, self.f).astype(np.float32), "beta": b} if BN in self.tail else {}
            fwd, y = self._send("block_forward", header, {"x": x, "w": w, "b": b} | norm, step)
            y.arrays = {k: spoil(k, a, step) for k, a in y.arrays.items()}
            dy = self.rng.standard_normal((self.n, self.f, 5, 5), dtype=np.float32)
            try:
                spot(7, fwd, y, BE)  # as the cluster's gather does, before the backward goes (with its probe)
                bwd, grads = self._send("block_backward", {"need_dx": True}, {"dy": dy}, step)
                grads.arrays = {k: spoil(k, a, step) for k, a in grads.arrays.items()}
                spot(7, bwd, grads, BE)
            except Lost as e:
                assert list(e.workers) == [7] and e.workers[7].startswith("wrong result: "), e.workers
                self.why = e.workers[7]
                return step
        return steps + 1


BN = {"op": "bn", "eps": 1e-5, "training": True}
BN_TAIL = [{"op": "relu"}, BN, {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1}]  # the default preset's


def test_honest_results_pass_even_off_by_round_off():
    """A worker whose every number is a few ulps off (another BLAS, another device) is never lost."""
    rng = np.random.default_rng(1)

    def ulps(name, a, step):
        return (a * (1 + rng.uniform(-8, 8, a.shape) * 2.0**-24)).astype(np.float32)

    spot = SpotCheck(budget=1.0)  # samples every step: the most chances of a false alarm
    assert Steps().run(spot, 40, ulps) == 41
    assert spot.samples >= 40


class DeadKernels(Steps):
    """Kernels whose bias cancels all but their largest sums: ReLU leaves outputs far smaller than their terms."""

    def _send(self, kind: str, header: dict, arrays: dict, step: int) -> tuple[Message, Message]:
        if kind == "block_forward":
            arrays["b"] = arrays["b"] - np.float32(5)
        return super()._send(kind, header, arrays, step)


def test_kernels_relu_all_but_kills_raise_no_alarm():
    """Their round-off is measured on the convolution's scale, before the tail (off by a third of the runs else)."""
    for seed in range(12):
        assert DeadKernels(seed=seed).run(SpotCheck(budget=1.0, seed=seed), 20) == 21


@pytest.mark.parametrize("factor", [-50.0, 1.01])
@pytest.mark.parametrize("tail", [TAIL, BN_TAIL], ids=["lrn", "batch norm"])
def test_results_scaled_are_caught_at_the_first_step(factor, tail):
    """x -50 poison and a 1 % perturbation of every result both fail the first step's sample."""
    assert Steps(tail=tail).run(SpotCheck(), 5, lambda name, a, step: a * np.float32(factor)) == 1


def test_a_batch_norm_tail_honest_passes_and_its_statistics_and_gradients_are_checked():
    """With batch norm in the tail the kernel samples recompute its batch statistics, dgamma and dbeta too (one
    image's output depends on the whole batch: no image samples); round-off raises no alarm, a wrong one is caught."""
    rng = np.random.default_rng(2)

    def ulps(name, a, step):
        return (a * (1 + rng.uniform(-8, 8, a.shape) * 2.0**-24)).astype(np.float32)

    for seed in range(3):
        spot = SpotCheck(budget=1.0, seed=seed)
        assert Steps(seed=seed, tail=BN_TAIL).run(spot, 20, ulps) == 21 and spot.samples >= 20
    for wrong in ("mean", "var", "dgamma", "dbeta"):
        spoil = lambda name, a, step, wrong=wrong: a * np.float32(1.05) if name == wrong else a  # noqa: E731
        assert Steps(tail=BN_TAIL).run(SpotCheck(budget=1.0), 5, spoil) == 1, wrong
    # an image's dx, through the batch's statistics (the worker's dgamma, dbeta), as without batch norm
    noise = lambda name, a, step: CHANNEL_FAULTS["noise on dx"](name, a) if step >= 3 else a  # noqa: E731
    assert Steps(tail=BN_TAIL).run(SpotCheck(budget=1.0), 5, noise) == 3


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
    """The checks' seconds stay within the budget of the worker's work at the master's rate, but for one sample
    of each kind and one step's floor and projection ahead; and the budget is spent, not hoarded. A fake clock
    makes every check cost the same, 1 s: at a budget of 0.15 a step earns 4.8 s, half of it for the checks of
    every step, whose floor and projection take 2, and the next probe 1 more while they are paid for (what they
    leave goes to the samples)."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(spot_check, "clock", lambda: float(next(ticks)))
    spot = SpotCheck(budget=0.15)
    Steps(n=16, f=24).run(spot, 200)
    # each sample reads the clock twice forward and twice backward: 1 s forward + 1 s backward
    credit = spot.workers[7].credit[0]
    assert spot.seconds - spot.earned == pytest.approx(-sum(credit.values()))
    assert 2 * 200 < spot.free_seconds <= 3 * 200  # the floor and the projection of every step, and some probes
    assert all(c >= -(2 + 3) for c in credit.values())  # at most one sample and a step's free checks ahead
    assert spot.earned - spot.seconds < 2 * 2  # and at most one sample behind: what it earns, it spends
    assert spot.samples > 10


def test_one_dear_step_does_not_cost_the_next_its_projection(monkeypatch):
    """The checks of every step keep in hand four times what they cost the last step (``HAND``): after steps that
    leave them some, a step dearer than theirs by 1.5 shares still leaves the next its probe. A fake clock: every
    check costs 1 s, the checks of every step 3 (the floor, the projection, the next probe) of a share of 5.2."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(spot_check, "clock", lambda: float(next(ticks)))
    spot, steps = SpotCheck(budget=0.3), Steps(n=16, f=24)
    spot.master_rate[0] = 1e-2  # a step earns the same every step: 10.4 s
    steps.run(spot, 8)
    share = spot_check.SHARES["every"] * spot.earned / 8
    assert share > 3
    spot.workers[7].credit[0]["every"] -= 3 + 1.5 * share  # a dear step
    asked, ask = [], spot.ask
    spot.ask = lambda k, task: asked.append(ask(k, task)) or asked[-1]
    steps.run(spot, 1)
    assert [set(a) for a in asked] == [set(), {"probe"}]  # the forward none, the backward its probe


def test_a_garbage_collection_inside_a_check_is_not_charged_to_it(monkeypatch):
    """The checks' clock leaves out the collector's seconds: of three ticks, the one a collection took."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(spot_sample.time, "perf_counter", lambda: float(next(ticks)))
    was = gc.isenabled()
    gc.disable()  # no collection but the one below
    try:
        t0 = spot_sample.clock()
        gc.collect()  # its start and its end read the clock
        assert spot_sample.clock() - t0 == 2.0
    finally:
        if was:
            gc.enable()


def test_the_budget_must_be_a_fraction():
    with pytest.raises(ValueError, match="fraction of each worker's work"):
        SpotCheck(budget=0.0)


class ChannelSteps:
    """A worker's tasks of a layer split by input channels, step after step: N images in chunks of ``chunk``,
    c of C input channels, F kernels of which it owns [6, 10) (its halo [2, 14)), the others' partial sums and
    conv-output gradients random; answered by a real worker and then, maybe, spoilt by ``spoil(name, array)``."""

    F, HALO, OWN, GIVE = 16, [2, 14], [4, 8], [10, 6]  # its halo in F; its own in the halo; rows the others need

    def __init__(self, backend=BE, n=8, chunk=4, c=3, hw=10, seed=0, tail=TAIL, same=False):
        self.rng, self.seed, self.same = np.random.default_rng(seed), seed, same
        self.n, self.chunk, self.c, self.hw, self.tail = n, chunk, c, hw, tail
        self.worker = Worker(backend)
        self.task = 0

    def _send(self, kind: str, header: dict, arrays: dict, step: int, spot: SpotCheck, spoil) -> Message:
        self.task += 1
        msg = Message(kind, {**header, "task": self.task, "step": step, "layer": 1}, arrays)
        msg.arrays |= spot.ask(7, msg)
        reply = self.worker.handle(msg)
        assert reply.kind == "result", reply.header
        reply.arrays = {k: spoil(k, a) for k, a in reply.arrays.items()}
        spot(7, msg, reply, BE)
        return reply

    def step(self, spot: SpotCheck, step: int, spoil=lambda name, a: a) -> None:
        self.rng = np.random.default_rng(self.seed) if self.same else self.rng
        self.now, (r, f, n, hw) = step, (self.rng, self.F, self.n, self.hw)
        x = r.standard_normal((n, self.c, hw, hw), dtype=np.float32)
        w = r.standard_normal((f, self.c, 5, 5), dtype=np.float32) * 0.2
        chunks = [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]
        settings = {"stride": 1, "padding": 2, "tail": self.tail, "halo": self.HALO, "own": self.OWN, "give": self.GIVE}
        for a, e in chunks:
            arrays = {"x": x[a:e]} | ({"w": w} if a == 0 else {})
            self._send("partial_forward", settings | {"images": [a, e, n]}, arrays, step, spot, spoil)
        halo = self.HALO[1] - self.HALO[0]
        for a, e in chunks:
            arrays = {"sum": r.standard_normal((halo, e - a, hw, hw), dtype=np.float32)}
            arrays |= {"b": r.standard_normal(halo, dtype=np.float32) * 0.1} if a == 0 else {}
            if a == 0 and BN in self.tail:
                arrays |= {"gamma": r.uniform(0.5, 2, halo).astype(np.float32), "beta": arrays["b"]}
            self._send("tail_forward", {"images": [a, e, n]}, arrays, step, spot, spoil)
        dy = r.standard_normal((n, halo, 5, 5), dtype=np.float32)
        for a, e in [(0, n)] if BN in self.tail else chunks:  # a tail with batch statistics: the whole batch
            self._send("tail_backward", {"images": [a, e, n]}, {"dy": dy[a:e]}, step, spot, spoil)
        for a, e in chunks:
            arrays = {name: r.standard_normal((6, e - a, hw, hw), dtype=np.float32) for name in ("dyc_lo", "dyc_hi")}
            self._send("partial_backward", {"need_dx": True, "images": [a, e, n]}, arrays, step, spot, spoil)

    def run(self, spot: SpotCheck, steps: int, spoil=lambda name, a: a) -> int:
        """Steps until the spot check loses the worker (its step), or ``steps`` + 1 if it never does."""
        for step in range(1, steps + 1):
            try:
                self.step(spot, step, spoil)
            except Lost as e:
                assert list(e.workers) == [7] and e.workers[7].startswith("wrong result: "), e.workers
                self.why = e.workers[7]
                return step
        return steps + 1


def test_the_split_by_channels_honest_passes_even_off_by_round_off():
    rng = np.random.default_rng(1)

    def ulps(name, a):
        return (a * (1 + rng.uniform(-8, 8, a.shape) * 2.0**-24)).astype(np.float32)

    spot = SpotCheck(budget=1.0)  # samples every step: the most chances of a false alarm
    assert ChannelSteps().run(spot, 40, ulps) == 41
    assert spot.samples >= 40 and spot.forgiven == 0


CHANNEL_FAULTS = {
    "x -50": lambda name, a: a * np.float32(-50),
    "1 % on every result": lambda name, a: a * np.float32(1.01),
    "1 % on dw only": lambda name, a: a * np.float32(1.01) if name == "dw" else a,
    "noise on dx": lambda name, a: (
        (a * (1 + 0.01 * np.cos(np.arange(a.size)).reshape(a.shape))).astype(np.float32) if name == "dx" else a
    ),
    "1 % on one p_hi row": lambda name, a: a * np.float32(1.01) if name == "p_hi" else a,
}


@pytest.mark.parametrize("fault", CHANNEL_FAULTS)
@pytest.mark.parametrize("tail", [TAIL, BN_TAIL], ids=["lrn", "batch norm"])
def test_the_split_by_channels_a_wrong_worker_is_caught_and_named(fault, tail):
    """Every result of the four tasks is sampled: a worker wrong in any of them is lost, "wrong result"."""
    assert ChannelSteps(tail=tail).run(SpotCheck(budget=1.0, seed=2), 3, CHANNEL_FAULTS[fault]) == 1


def test_the_split_by_channels_with_batch_norm_honest_passes_and_its_numbers_are_checked():
    rng = np.random.default_rng(3)

    def ulps(name, a):
        return (a * (1 + rng.uniform(-8, 8, a.shape) * 2.0**-24)).astype(np.float32)

    spot = SpotCheck(budget=1.0)
    assert ChannelSteps(tail=BN_TAIL).run(spot, 30, ulps) == 31 and spot.samples >= 30
    for wrong in ("mean", "var", "dgamma", "dbeta"):
        spoil = lambda name, a, wrong=wrong: a * np.float32(1.05) if name == wrong else a  # noqa: E731
        assert ChannelSteps(tail=BN_TAIL).run(SpotCheck(budget=1.0), 20, spoil) <= 20, wrong  # a kernel it owns


@pytest.mark.parametrize("fault", ["x -50", "1 % on every result"])
def test_the_split_by_channels_a_worker_scaled_is_caught_at_the_first_step_within_the_budget(fault):
    assert ChannelSteps().run(SpotCheck(), 3, CHANNEL_FAULTS[fault]) == 1


@pytest.mark.parametrize(("stride", "padding"), [(1, 2), (2, 1), (3, 0)])
def test_the_kernel_samples_few_kernels_convolution_equals_the_plain_one(stride, padding):
    """The optimisation of the kernel samples: its forward and dw equal the backend's to round-off."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7, 11, 11), dtype=np.float32)
    w = rng.standard_normal((3, 7, 5, 5), dtype=np.float32)
    b = rng.standard_normal(3, dtype=np.float32)
    y, cache = BE.conv2d_forward(x, w, b, stride, padding)
    xp = spot_sample.padded(x, padding)
    k = 7 * 25 + 1
    assert np.abs(spot_sample.few_kernels_forward(xp, w, b, stride) - y).max() <= spot_sample.pair(y, y, k)[2]
    d = rng.standard_normal(y.shape, dtype=np.float32)
    _, dw, _ = BE.conv2d_backward(d, cache, need_dx=False)
    k = d.shape[0] * d.shape[2] * d.shape[3]
    assert np.abs(spot_sample.few_kernels_dw(xp, d, stride, 5) - dw).max() <= spot_sample.pair(dw, dw, k)[2]


@pytest.mark.parametrize("name", ["y", "dw", "db"])
def test_a_wrong_shape_or_a_missing_array_is_left_to_the_split(name):
    """Not the spot check's to judge: the split's own check loses the worker, with its reason."""
    spot = SpotCheck(budget=1.0)
    assert ChannelSteps().run(spot, 1, lambda n, a: a[:-1] if n == name else a) == 2
    assert Steps().run(spot, 1, lambda n, a, step: a[:-1] if n == name else a) == 2
    for steps in (Steps(), ChannelSteps()):
        answer = steps.worker.handle
        steps.worker.handle = lambda msg, answer=answer: _without(answer(msg), name)
        assert steps.run(spot, 1) == 2


def _without(reply: Message, name: str) -> Message:
    reply.arrays.pop(name, None)
    return reply


def test_a_wrong_backward_alone_is_caught_by_its_projection_at_its_first_step():
    """A worker whose forward is right but whose dw is 1 % off from step 3: its dw against the sums it sent along
    the probe (the top singular pair of its last dw), both splits, before any sample of that step's backward. Each
    step's arrays are the last's, as a slowly turning gradient's would be nearly."""
    by_kernels, by_channels = Steps(n=32, f=40, same=True), ChannelSteps(n=32, same=True)
    for steps, spoil in (
        (by_kernels, lambda name, a, step: a * np.float32(1.01) if name == "dw" and step >= 3 else a),
        (by_channels, lambda name, a: a * np.float32(1.01) if name == "dw" and by_channels.now >= 3 else a),
    ):
        assert steps.run(SpotCheck(budget=1.0, seed=3), 6, spoil) == 3 and "against its projection" in steps.why


@pytest.mark.parametrize("fault", ["1 % on every result", "noise on dx", "1 % on one p_hi row"])
def test_the_split_by_channels_checks_its_partials_or_dx_at_one_place_each_step(fault):
    """Its P rows the others read, or its dx, each at one image, row and column, every step that pays for one (the
    two take turns, the forward's first): a worker 1 % off from step 3 is lost at step 3 (P), or 4 (dx), with no
    sample taken."""
    steps, spot = ChannelSteps(), SpotCheck(budget=1.0)
    spot._place = lambda *where: None  # no image or kernel to sample: the places alone
    spoil = lambda name, a: CHANNEL_FAULTS[fault](name, a) if steps.now >= 3 else a  # noqa: E731
    assert steps.run(spot, 10, spoil) == (4 if fault == "noise on dx" else 3) and spot.samples == 0
    assert ("at (" in steps.why) and ("dx" in steps.why) == (fault == "noise on dx"), steps.why


@pytest.mark.parametrize("split", ["kernels", "channels"])
@pytest.mark.parametrize("spoil, says", [(lambda a: None, "it sent none"), (lambda a: a[:1], "it sent (1,)")])
def test_a_worker_that_skips_or_mangles_its_projection_is_lost(split, spoil, says):
    """Asked for its dw's sums along a probe (every step after the first), it must send them: else it is lost."""
    steps = Steps() if split == "kernels" else ChannelSteps()
    answer = steps.worker.handle

    def handle(msg):
        reply = answer(msg)
        if "probes" in reply.arrays:
            got = spoil(reply.arrays.pop("probes"))
            reply.arrays |= {} if got is None else {"probes": got}
        return reply

    steps.worker.handle = handle
    assert steps.run(SpotCheck(budget=1.0), 3) == 2 and f"asked for its dw's projection, {says}" in steps.why


def test_the_floor_catches_a_sign_or_a_variance_below_0_whatever_the_credit():
    """x -50 from step 4, at a budget that pays for no sample after the first: the outputs' signs behind ReLU, LRN
    and max pool, and batch norm's batch variances, are checked every step."""
    for tail, says in ((TAIL, "its smallest output, which ReLU"), (BN_TAIL, "its smallest batch variance")):
        steps, spot = Steps(tail=tail), SpotCheck(budget=1e-6)
        spoil = lambda name, a, step: a * np.float32(-50) if step >= 4 else a  # noqa: E731
        assert steps.run(spot, 6, spoil) == 4 and spot.samples == 2 and steps.why.startswith(f"wrong result: {says}")
    steps = Steps(tail=BN_TAIL)
    only_var = lambda name, a, step: -a if name == "var" and step >= 2 else a  # noqa: E731
    assert steps.run(SpotCheck(budget=1e-6), 3, only_var) == 2 and "a mean of squares, is -" in steps.why


@pytest.mark.parametrize("stride, padding", [(1, 2), (2, 1), (2, 0)])
def test_one_place_of_a_convolution_is_the_backends_there_within_its_bound(stride, padding):
    """spot_place's output and input gradient at every place of an image equal the backend's convolution and its
    dx there, within float32 round-off of their terms (the border's padding made by hand)."""
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((2, 3, 9, 9), dtype=np.float32), rng.standard_normal((4, 3, 5, 5), dtype=np.float32)
    y, cache = BE.conv2d_forward(x, w, np.zeros(4, np.float32), stride, padding)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx, _, _ = BE.conv2d_backward(dy, cache, True)
    for r in range(y.shape[2]):
        for c in range(y.shape[3]):
            ref, terms = spot_place.output_at(w, x[1], r, c, stride, padding)
            assert np.all(np.abs(y[1, :, r, c] - ref) <= float32_tolerance(3 * 25, terms))
    for r in range(9):
        for c in range(9):
            ref, terms = spot_place.dx_at(w, dy[1], r, c, stride, padding)
            assert np.all(np.abs(dx[1, :, r, c] - ref) <= float32_tolerance(4 * 25 + 25 + 2, terms))


@pytest.mark.parametrize(
    "ops, never",
    [
        (["relu", "lrn", "maxpool"], True),
        (["bn", "relu", "maxpool"], True),
        (["relu"], True),
        (["relu", "bn", "maxpool"], False),
        (["lrn", "maxpool"], False),
        ([], False),
    ],
)
def test_a_tail_leaves_nothing_below_0_when_only_lrn_and_max_pool_follow_its_last_relu(ops, never):
    assert free_checks.never_negative(ops) is never


@pytest.fixture
def opencl(tmp_path_factory):
    pytest.importorskip("pyopencl")
    from backends.opencl import NoOpenCLDevice, OpenCLBackend

    try:
        return OpenCLBackend(autotune=False, tune_file=tmp_path_factory.mktemp("tune") / "gemm.json")
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device on this machine: {e}")


def test_honest_opencl_workers_raise_no_alarm_against_a_numpy_master(opencl):
    """Another device's round-off, both splits, every step sampled: never a false alarm."""
    spot = SpotCheck(budget=1.0)
    steps = Steps()
    steps.worker = Worker(opencl)
    assert steps.run(spot, 20) == 21
    assert ChannelSteps(opencl).run(spot, 20) == 21
    assert spot.samples >= 40


class ScaledByChannels(Worker):
    """Answers the tasks of a layer split by input channels with their numbers times -50: finite and wrong."""

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if msg.kind in ("partial_forward", "tail_forward", "tail_backward", "partial_backward"):
            reply.arrays = {k: a * np.float32(-50) for k, a in reply.arrays.items()}
        return reply


def train(makes, steps: int, **options):
    """``steps`` steps of 6:12 on 8 x 8 images by the master and workers ``makes`` (backend -> handler), split by
    input channels in chunks of two images (conv2; conv1 by kernels); (the losses, the cluster, its events)."""
    rng = np.random.default_rng(4)
    net = paper_net("6:12", NumpyBackend(), seed=0, image_size=8)
    transport = InprocTransport(lambda i: makes[i](NumpyBackend()), protocol=VERSION)
    with transport:
        workers = transport.start(len(makes), timeout=20.0)
        cluster = Cluster(transport, workers, NumpyBackend(), split="channels", pipeline=2, rebalance=False, **options)
        cluster.attach(net)
        losses = []
        for _ in range(steps):
            x, y = rng.standard_normal((4, 3, 8, 8), dtype=np.float32), rng.integers(0, 10, 4)
            losses.append(cluster.train_batch(net, x, y)[0])
        return losses, cluster, cluster.pop_events()


def test_a_run_split_by_channels_with_the_check_on_equals_the_unsharded_one():
    losses, cluster, events = train([Worker, Worker], 3, spot_check=1.0)
    alone, rng = paper_net("6:12", NumpyBackend(), seed=0, image_size=8), np.random.default_rng(4)
    for loss in losses:  # the same batches, the same SGD steps: the numbers agree to float32 round-off
        x, y = rng.standard_normal((4, 3, 8, 8), dtype=np.float32), rng.integers(0, 10, 4)
        ref, _ = forward_backward(alone, x, y)
        assert loss == pytest.approx(ref, rel=1e-5)
    assert events == [] and cluster.spot.samples >= 2 * 2 * 2  # the first step's: both kinds, convs and workers


def test_a_worker_split_by_channels_scaled_x_minus_50_is_caught_at_its_first_step():
    _, cluster, events = train([Worker, ScaledByChannels], 1)
    assert [(e["event"], e["worker"], e["step"]) for e in events] == [("worker_lost", "worker1", 0)]
    assert events[0]["reason"].startswith("wrong result: its smallest output, which ReLU, LRN and max pool leave at 0")
    assert cluster.step == 1
