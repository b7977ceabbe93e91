"""The spot check of the splits by images: one image a step run forward, the last bias against the logits, each
dW against its projection, one image forward and backward, and now and then the worker's whole task replayed.

An honest worker, on numpy or OpenCL, is never lost and the step is the same as without the check; a wrong
one (every number x -50, one parameter's gradient 1 % off, the logits or features 1 % off, a dX off inside
it) is lost with reason "wrong result" at its first step (always replayed), or, wrong from a later step, at
that step (its image checked), and its images go to the others in the same step.
In-process workers; every wait has a timeout; no test sleeps.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_data_parallel import SIZE, TIMEOUT, batch, data_parallel_step, inproc_pool

from backends.conformance.checks import FN, float32_tolerance
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.replica import flat, inner_ops, one_image, probe
from tinyconv.distributed.replica.batch import UNIT
from tinyconv.distributed.replica.conv_part import conv_part
from tinyconv.distributed.replica.hybrid import Hybrid
from tinyconv.distributed.replica.one_image import roundings
from tinyconv.distributed.replica.replay_check import ReplayCheck
from tinyconv.distributed.replica.replica import slice_gradients
from tinyconv.distributed.replica.server import Replicas
from tinyconv.distributed.spot_sample import pair
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import LocalResponseNorm, MaxPool2D
from tinyconv.model import paper_net
from tinyconv.optim import SGD

PARALLEL = {"data": Replicas, "hybrid": Hybrid}


class Wrong(Worker):
    """A worker that spoils its answers' array ``name`` with ``spoil`` from its ``at``-th answer of that array on."""

    def __init__(self, name: str, spoil, at: int = 1) -> None:
        super().__init__(NumpyBackend())
        self.name, self.spoil, self.at, self.answers = name, spoil, at, 0

    def handle(self, msg):
        reply = super().handle(msg)
        if self.name in reply.arrays:
            self.answers += 1
            if self.answers >= self.at:
                reply.arrays[self.name] = self.spoil(reply.arrays[self.name]).astype(np.float32)
        return reply


def first_param_off(a: np.ndarray) -> np.ndarray:
    """conv1.w's gradient 1 % off, every other parameter's as it was."""
    n = flat.sizes(paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE))[0]
    return np.concatenate([a[:n] * np.float32(1.01), a[n:]])


def conv2_off(a: np.ndarray) -> np.ndarray:
    """conv2.w's gradient 1 % off (every other parameter's as it was): what no last bias or norm shows."""
    n = flat.sizes(paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE))
    lo = n[0] + n[1]
    return np.concatenate([a[:lo], a[lo : lo + n[2]] * np.float32(1.01), a[lo + n[2] :]])


def runtime(parallel: str, transport, workers, budget: float = 0.03):
    """``parallel`` over the pool, slices 2, 3, 3 kept (the rebalancer would follow the machine's noise)."""
    run = PARALLEL[parallel](
        transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE, spot_check=budget, rebalance=False
    )
    run.set_plan(UNIT, [2, 3, 3])
    return run


@pytest.mark.parametrize("norm", ["lrn", "batch"])
@pytest.mark.parametrize("parallel", PARALLEL)
def test_an_honest_worker_is_replayed_and_kept_and_the_step_is_the_unchecked_one(parallel, norm):
    x, y = batch(8)
    with inproc_pool(2) as (transport, workers):
        unchecked = data_parallel_step(runtime(parallel, transport, workers, budget=0), x, y, norm)
        checked = runtime(parallel, transport, workers)
        for _ in range(3):
            checked.spot.credit.clear()  # as at the start: every task replayed
            got = data_parallel_step(checked, x, y, norm)
    assert not checked.lost and checked.spot.samples == 3 * 2
    np.testing.assert_array_equal(got[0], unchecked[0])  # the master's own numbers never change
    assert checked.spot.seconds > 0 and checked.spot.earned > 0


@pytest.mark.parametrize(
    ("parallel", "name", "spoil", "what"),
    [
        ("data", "grads", lambda a: a * np.float32(-50), "the gradient of fc1.b against its logits"),
        ("data", "logits", lambda a: a * np.float32(1.01), "the gradient of fc1.b against its logits"),
        ("hybrid", "features", lambda a: a * np.float32(1.01), "features"),
    ],
)
def test_a_wrong_worker_is_lost_at_its_first_replayed_step_and_the_step_is_still_right(parallel, name, spoil, what):
    x, y = batch(8)
    with inproc_pool(2) as (transport, workers):
        reference = data_parallel_step(runtime(parallel, transport, workers, budget=0), x, y)
    make = lambda i: Wrong(name, spoil) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        got = data_parallel_step(run, x, y)
    (event,) = run.pop_events()
    assert event["worker"] == "worker1" and event["reason"].startswith(f"wrong result: {what} in its "), event
    assert run.participants == ["master", "worker0"] and sum(run.last_step["shares"][UNIT]) == 8
    np.testing.assert_allclose(got[2], reference[2], rtol=1e-5)  # the loss: its images went to the others


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_replayed_gradient_far_off_loses_the_worker_at_its_first_replay(parallel):
    """conv1.w's gradient x -50 from the first step, every other answer right: the first step's replay loses it at
    once (no per-step check has its probe yet), beyond the rigorous bound on the backward of absolute values."""
    spoil = lambda g: np.concatenate([g[:1] * np.float32(-50), g[1:]])  # noqa: E731
    make = lambda i: Wrong("grads", spoil) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers, budget=1e-6)  # no replay but the first
        train(run, 2, "batch", every_image=False, every_kernel=False)
    (event,) = run.pop_events()
    assert event["step"] == 0 and event["reason"].startswith("wrong result: the gradient of conv1.w"), event
    assert run.spot.forgiven == 0


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_result_far_off_is_lost_at_its_first_step_whatever_the_credit(parallel):
    """Every answer's gradient x -50 from the third step, on a budget that pays for nothing after the first
    step's replay (a small network's 3 %): the step's floor, the last bias (data) or the last norm (the hybrid),
    runs whatever the credit, and loses the worker at the fault's first step."""
    make = lambda i: Wrong("grads", lambda g: g * np.float32(-50), at=3) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers, budget=1e-6)
        train(run, 4, "batch", every_image=False, every_kernel=False)
    (event,) = run.pop_events()
    what = {"data": "fc1.b against its logits", "hybrid": "bn2.beta against its features"}[parallel]
    assert event["step"] == 2 and event["reason"].startswith(f"wrong result: the gradient of {what}"), event
    assert run.spot.samples == 2 and run.spot.backwards == 0, (run.spot.samples, run.spot.backwards)


def test_the_hybrids_features_below_0_after_relu_lrn_and_max_pool_are_lost_at_their_first_step_whatever_the_credit():
    """With LRN there is no last norm to check: features x -50 from the third step are below 0, which ReLU, LRN and
    a max pool never leave (free_checks.last_signs), and the floor loses the worker at that step on a budget that
    pays for nothing else."""
    make = lambda i: Wrong("features", lambda f: f * np.float32(-50), at=3) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime("hybrid", transport, workers, budget=1e-6)
        train(run, 4, "lrn", every_image=False, every_kernel=False)
    (event,) = run.pop_events()
    assert event["step"] == 2 and event["reason"].startswith("wrong result: its smallest feature"), event
    assert run.spot.samples == 2 and run.spot.backwards == 0, (run.spot.samples, run.spot.backwards)


class NoSums(Worker):
    """Answers every task, but never with the sums along the probe it was sent."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())

    def handle(self, msg):
        reply = super().handle(msg)
        reply.arrays.pop("probes", None)
        return reply


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_worker_asked_for_its_sums_along_a_probe_that_sends_none_is_lost_whatever_the_credit(parallel):
    """Dropping the projections would dodge every check on them: its first step with a probe (the second) loses it."""
    make = lambda i: NoSums() if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers, budget=1e-6)
        train(run, 3, every_image=False, every_kernel=False)
    (event,) = run.pop_events()
    assert event["step"] == 1 and "wrong result: asked for the sums along its probe" in event["reason"], event


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_replay_waits_for_credit_that_pays_for_what_the_last_one_cost(parallel):
    """After the first step's replay, a worker's task is replayed again only when its replay credit holds what the
    last replay cost: a run's checks stay within its budget, but for that first replay until it is paid back."""
    with inproc_pool(2) as (transport, workers):
        run = runtime(parallel, transport, workers, budget=1e-6)
        spot = run.spot
        train(run, 1, every_image=False, every_kernel=False)
        assert spot.samples == 2 and spot._replay_s > 0  # each worker's first step
        spot.credit.update(dict.fromkeys(spot.credit, spot._replay_s / 2))  # credit, less than a replay costs
        train(run, 1, every_image=False, every_kernel=False)
        assert spot.samples == 2
        spot.credit.update(dict.fromkeys(spot.credit, 1e9))
        train(run, 1, every_image=False, every_kernel=False)
        assert spot.samples == 4


def test_a_call_that_checked_no_image_does_not_set_what_a_backward_costs():
    """Before a worker's first probe there is no image to check: that call's seconds are not what one image's
    backward costs (the backward credit's threshold and its cap: a backward would run on any crumb of credit)."""
    spot = ReplayCheck(0.03)
    spot.back_credit[0], spot._back_s = 1.0, 0.25
    spot._backward_check(0, "replica_step", lambda: [])
    assert spot._back_s == 0.25 and spot.backwards == 0


class WithinRoundOff(Worker):
    """conv1.w's first gradient entry moved half-way from the scale form's bound to the rigorous one on the
    backward of absolute values (replica/magnitudes.py), which batch norm's cancelling backward makes larger."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())

    def handle(self, msg):
        reply = super().handle(msg)
        if msg.kind in ("replica_step", "hybrid_forward"):
            self.first = (msg, reply)
        if "grads" not in reply.arrays:
            return reply
        mags = ReplayCheck(1.0)._magnitudes([self.first] + ([(msg, reply)] if msg.kind == "hybrid_backward" else []))
        net = self.state.replica[1]
        k = roundings(net if msg.kind == "replica_step" else conv_part(net), self.first[0].arrays["x"].shape)[1]
        n = mags["conv1.w"].size + mags["conv1.b"].size
        grads = reply.arrays["grads"].copy()
        scale_form = float32_tolerance(k, float(np.abs(grads[:n]).max()))
        rigorous = float32_tolerance(k, max(float(mags[p].max()) for p in ("conv1.w", "conv1.b")))
        assert rigorous > 4 * scale_form, (rigorous, scale_form)
        grads[0] += np.float32((scale_form + rigorous) / 2)
        reply.arrays["grads"] = grads
        return reply


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_replayed_gradient_within_the_rigorous_bound_is_forgiven_not_lost(parallel):
    make = lambda i: WithinRoundOff() if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers, budget=1e-6)  # no replay but the first
        train(run, 1, "batch", every_image=False, every_kernel=False)
    assert not run.lost and run.spot.forgiven == 1 and run.spot.samples == 2


def train(
    run,
    steps: int,
    norm: str = "lrn",
    every_image: bool = True,
    every_kernel: bool | None = True,
    replays: bool = True,
) -> list[float]:
    """``steps`` SGD steps of paper_net 6:10 under ``run``, on a new batch of 8 each: the losses. ``every_image``,
    ``every_kernel``: that credit made ample before each step, so that an image (the hybrid: a kernel sample) is
    checked whatever the machine's speed (``every_kernel=None``: no kernel sample); ``replays=False``: none but each
    worker's first."""
    net = paper_net("6:10", NumpyBackend(), norm, seed=0, image_size=SIZE)
    opt = SGD(net, lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        if every_image:  # credit for any check, the rest going to the replays
            run.spot.image_credit.update(dict.fromkeys(run.spot.credit, 1.0))
            run.spot.back_credit.update(dict.fromkeys(run.spot.credit, 1.0))
        if every_kernel:
            run.spot.kernel_credit.clear()
        elif every_kernel is None:
            run.spot.kernel_credit.update(dict.fromkeys(run.spot.credit, -1e9))
        if not replays:
            run.spot.credit.update(dict.fromkeys(run.spot.credit, -1e9))
        losses.append(run.train_batch(net, *batch(8, step))[0])
        opt.step()
    return losses


@pytest.mark.parametrize("norm", ["lrn", "batch"])
@pytest.mark.parametrize("parallel", PARALLEL)
def test_after_the_first_step_one_image_a_step_is_checked_and_an_honest_worker_kept(parallel, norm):
    with inproc_pool(2) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 12, norm)
    assert not run.lost
    assert run.spot.images == 2 * 11 and run.spot.samples >= 2  # the workers' first steps replayed whole


@pytest.mark.parametrize(
    ("parallel", "name", "spoil", "what"),
    [
        ("data", "logits", lambda a: a * np.float32(-50), "image "),
        ("data", "logits", lambda a: a * np.float32(1.01), "image "),
        ("hybrid", "features", lambda a: a * np.float32(-50), "image "),
        ("hybrid", "features", lambda a: a * np.float32(1.01), "image "),
    ],
)
@pytest.mark.parametrize("norm", ["lrn", "batch"])
def test_a_worker_wrong_from_a_later_step_is_lost_at_that_step(parallel, name, spoil, what, norm):
    make = lambda i: Wrong(name, spoil, at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, norm)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event  # its 5th step, the first wrong one
    assert event["reason"].startswith(f"wrong result: {what}"), event


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_gradient_wrong_alone_from_a_later_step_is_lost_at_that_step(parallel):
    """Data parallelism's last bias follows from the logits; with batch norm before the last pool, so do the
    hybrid's last norm's dbeta and dgamma from the features and dL/dfeatures: no image or replay needed."""
    make = lambda i: Wrong("grads", lambda a: a * np.float32(1.01), at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, "batch", every_kernel=False)  # credit for every check: the free ones come first
    (event,) = run.pop_events()
    what = "fc1.b against its logits" if parallel == "data" else "bn2.beta against its features"
    assert event["step"] == 4 and event["reason"].startswith(f"wrong result: the gradient of {what}"), event


def test_the_hybrids_last_norm_catches_its_dgamma_alone_wrong_at_its_first_step():
    """Only bn2.gamma's gradient 1 % off (its dbeta, the features and every other gradient as they were), on a
    budget that pays for nothing after the first step's replay: the floor's dgamma, from the features and
    dL/dfeatures, loses the worker at that step, whichever run of channels it drew."""
    at = flat.spans(conv_part(paper_net("6:10", NumpyBackend(), "batch", seed=0, image_size=SIZE)))["bn2.gamma"]

    def gamma_off(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a[at] *= np.float32(1.01)
        return a

    make = lambda i: Wrong("grads", gamma_off, at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime("hybrid", transport, workers, budget=1e-6)
        train(run, 6, "batch", every_image=False, every_kernel=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event
    assert event["reason"].startswith("wrong result: the gradient of bn2.gamma against its features"), event


@pytest.mark.parametrize("norm", ["lrn", "batch"])
def test_the_hybrids_kernel_sample_alone_catches_wrong_features_at_their_first_step(norm):
    make = lambda i: Wrong("features", lambda a: a * np.float32(-50), at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime("hybrid", transport, workers, budget=1e-6)  # no whole image checked, no replay after the first
        train(run, 6, norm, every_image=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event
    assert event["reason"].startswith("wrong result: image ") and "'s feature of kernel " in event["reason"], event
    assert run.spot.images == 0


@pytest.mark.parametrize("norm", ["lrn", "batch"])
def test_the_kernel_samples_receptive_field_gives_the_whole_images_feature_at_every_position(norm):
    """One feature from its receptive field alone (one_image.feature: the padding made by hand at the borders)
    equals the whole image's forward at every kernel and position, within the round-off it is held to."""
    rng = np.random.default_rng(3)
    conv = conv_part(paper_net("6:10", NumpyBackend(), norm, seed=0, image_size=SIZE))
    for layer in (layer for layer in conv.layers if layer.kind == "bn"):  # statistics of a slice, not 0 and 1
        layer.buffers["running_mean"] = rng.standard_normal(layer.channels).astype(np.float32) * np.float32(0.1)
        layer.buffers["running_var"] = (1 + rng.random(layer.channels)).astype(np.float32)
    x = rng.standard_normal((1, 3, SIZE, SIZE)).astype(np.float32)
    whole = conv.forward(x)[0]
    k = roundings(conv, x.shape)[0]
    for j, r, c in itertools.product(*map(range, whole.shape)):
        mine, top = one_image.feature(conv, x, j, r, c)
        got, ref, tol = pair(whole[j, r, c].reshape(1), mine, k, top)
        assert abs(float(got[0]) - float(ref[0])) <= tol, (j, r, c, got, ref, tol)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_convolutions_gradient_wrong_alone_is_lost_at_its_first_step_by_its_projection(parallel):
    """From its second step each worker gets the top singular pair of its last dW with its task and returns the
    sums whose u^T dW v the master compares: a dW 1 % off, with LRN (no last norm), is caught at once."""
    make = lambda i: Wrong("grads", conv2_off, at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, "lrn", every_kernel=False)  # credit for every check: the free ones come before the replay
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event
    assert event["reason"].startswith("wrong result: the gradient of conv2.w against its projection"), event


def test_the_probe_is_uT_dW_v_within_its_bound_and_its_one_kernel_convolution_the_backends():
    be = NumpyBackend()
    net = paper_net("6:10", be, "lrn", seed=0, image_size=SIZE)
    x, y = batch(4)
    seen = ({}, {})
    slice_gradients(net, x, y, 4, 0.0, seen)
    p = np.random.default_rng(0).standard_normal(probe.size(net)).astype(np.float32)
    got = probe.project(net, p, *seen).reshape(2, 2 + len(x))  # per convolution: s, a, each image's sum of dY^2
    checks = zip(probe.convs(net), probe.pairs(net, p), got, probe.roundings(net, x.shape), strict=True)
    for c, (u, v), (s, a, *energies), k in checks:
        dw = be.to_numpy(c.grads["w"]).reshape(c.out_channels, -1).astype(np.float64)
        exact = u.astype(np.float64) @ dw @ v.ravel().astype(np.float64)
        assert abs(exact - s) <= float32_tolerance(k, float(a)) and a >= abs(s), (c.name, exact, s, a)
        dy = seen[1][c.name].astype(np.float64)
        np.testing.assert_allclose(energies, (dy * dy).sum(axis=(1, 2, 3)), rtol=1e-6)
        xin = seen[0][c.name]
        ref = be.conv2d_forward(xin, v[None], np.zeros(1, np.float32), c.stride, c.padding)[0][:, 0]
        terms = probe.one_kernel(np.abs(xin), np.abs(v), c.stride, c.padding)
        assert np.all(
            np.abs(probe.one_kernel(xin, v, c.stride, c.padding) - ref) <= float32_tolerance(2 * v.size, terms)
        )


def test_the_budget_is_a_fraction_and_the_roundings_are_every_reduction_of_the_path():
    with pytest.raises(ValueError, match="fraction of each worker's work"):
        ReplayCheck(0)
    net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)  # conv, relu, lrn, pool twice; fc
    lrn = 5 + 2 + FN
    forward = (3 * 25 + 1) + lrn + (6 * 25 + 1) + lrn + (10 * 4 * 4 + 1)
    backward = (6 * 25 + 2 * 16 * 16) + lrn + (10 * 25 + 2 * 8 * 8) + lrn + (10 + 2)  # dx's and dw's sums, n = 2
    assert roundings(net, (2, 3, SIZE, SIZE)) == (forward, forward + backward)


def test_an_honest_opencl_worker_is_never_found_wrong():
    pytest.importorskip("pyopencl")
    from backends.opencl import NoOpenCLDevice, OpenCLBackend

    try:
        be = OpenCLBackend(autotune=False)
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device on this machine: {e}")
    with inproc_pool(2, lambda i: Worker(be)) as (transport, workers):
        for parallel, norm in itertools.product(PARALLEL, ("lrn", "batch")):
            # PoCL builds each kernel at its first run, and the first OpenCL worker to answer paces the other
            # (uncalibrated: 2 x its share at that pace + 1 s): a step first, unchecked, that may lose them
            data_parallel_step(runtime(parallel, transport, workers, budget=0), *batch(8), norm=norm)
            run = runtime(parallel, transport, workers)
            for seed in range(5):
                run.spot.credit.clear()  # every task replayed
                data_parallel_step(run, *batch(8, seed), norm=norm)
            assert not run.lost and run.spot.samples == 10, (parallel, norm, run.lost)
            run = runtime(parallel, transport, workers)
            train(run, 5, norm)  # the first step replayed, an image a step checked after it, forward and backward
            assert not run.lost and run.spot.images == run.spot.backwards == 2 * 4, (parallel, norm, run.lost)


class UnderTheBound(Worker):
    """From its 5th answer on, conv1.w's gradient moved along the probe's u v^T by three quarters of what its
    projection's check allows that step: each step passes, every step leans the same way."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())
        self.answers = 0

    def handle(self, msg):
        reply = super().handle(msg)
        if msg.kind in ("replica_step", "hybrid_forward"):
            self.task = msg  # the probe and the slice the gradient will come from
        if "probes" not in reply.arrays:
            return reply
        self.answers += 1
        part = self.state.replica[1] if msg.kind == "replica_step" else conv_part(self.state.replica[1])
        (u, v), (s, a) = probe.pairs(part, self.task.arrays["probe"])[0], reply.arrays["probes"][:2]
        k = probe.roundings(part, self.task.arrays["x"].shape)[0]
        if self.answers >= 5:
            bound = probe.tolerance(k, float(a)) + 2**-23 * abs(float(s))
            move = np.outer(u, v.ravel()).ravel() * np.float32(0.75 * bound / float((u @ u) * (v.ravel() @ v.ravel())))
            reply.arrays["grads"] = reply.arrays["grads"].copy()
            reply.arrays["grads"][: move.size] += move
        return reply


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_gradient_off_by_less_than_each_steps_bound_is_caught_by_its_sum_over_steps(parallel):
    """No step's check of conv1's projection sees UnderTheBound's gradient, the sum of the last few does
    (replica/probe.py: their bound grows as the root of the steps, the lean as the steps)."""
    make = lambda i: UnderTheBound() if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 12, every_kernel=False)
    (event,) = run.pop_events()
    assert 5 <= event["step"] <= 11 and event["worker"] == "worker1", event
    assert event["reason"].startswith("wrong result: the gradient of conv1.w against its projection, summed over"), (
        event
    )


class WrongDx(NumpyBackend):
    """A backend whose ``op``'s dx is off by ``factor`` from its ``at``-th call of it on (``every``: of each ``every``
    calls, the last): a faulty dX GEMM (conv2's, in paper_net), batch norm backward or max pool backward, which every
    sum the worker makes below it then follows."""

    def __init__(self, op: str, factor: float, at: int, every: int = 1) -> None:
        super().__init__()
        self.factor, self.at, self.every, self.calls = np.float32(factor), at, every, 0
        honest = getattr(self, op)

        def spoiled(*args):
            out = honest(*args)
            dx = out[0] if isinstance(out, tuple) else out
            if dx is None:
                return out
            self.calls += 1
            if self.calls >= self.at * self.every and self.calls % self.every == 0:
                dx = dx * self.factor
            return (dx, *out[1:]) if isinstance(out, tuple) else dx

        setattr(self, op, spoiled)


@pytest.mark.parametrize("norm", ["lrn", "batch"])
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_wrong_dX_the_workers_sums_follow_is_lost_by_its_sample_at_its_first_step(parallel, norm):
    """conv2's dX 1 % off inside the worker: dW, its projection and the logits all agree with it; the dX the worker
    returns at one position does not agree with W times its window of dY (replica/inner_ops.py), checked with the
    projections, before one image's backward."""
    make = lambda i: Worker(WrongDx("conv2d_backward", 1.01, at=5)) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, norm, every_kernel=False, replays=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event
    assert event["reason"].startswith("wrong result: conv2's dX at one position against its window of dY"), event


@pytest.mark.parametrize(
    ("op", "norm", "what"),
    [
        ("batchnorm_backward", "batch", "bn1's sum dx dy against its dbeta and dgamma"),
        ("relu_lrn_backward", "lrn", "lrn1's dx at one position against its input and dy"),
    ],
)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_wrong_norm_dx_the_workers_sums_follow_is_lost_by_its_check_at_its_first_step(parallel, op, norm, what):
    """A norm's dx 1 % off inside the worker (both norms', from the 9th call: the 5th step), checked with the
    projections (replica/inner_ops.py): batch norm's sum dx dy no longer equals g (e - dbeta^2 / M - dgamma^2 / M)
    from the gradient it sent; ReLU + LRN's dx at one position no longer follows from the input and dy there."""
    make = lambda i: Worker(WrongDx(op, 1.01, at=9)) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, norm, every_kernel=False, replays=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1", event
    assert event["reason"].startswith(f"wrong result: {what}"), event


def test_the_hybrids_features_off_alone_are_lost_at_their_first_step_by_the_lrn_output_its_pool_took():
    """The hybrid's features 1 % noise alone, with no kernel sample and no image checked: the last LRN's output at the
    position the worker samples (from its input there) is the feature its max pool took (replica/inner_ops.py)."""
    noisy = lambda a: a * (1 + np.float32(0.01) * np.random.default_rng(0).standard_normal(a.shape))  # noqa: E731
    make = lambda i: Wrong("features", noisy, at=5) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime("hybrid", transport, workers)
        run.spot._image_s = np.inf  # credit for the free checks, none of it enough for an image forward
        train(run, 6, "lrn", every_kernel=None, replays=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1" and run.spot.images == 0, event
    assert event["reason"].startswith("wrong result: lrn2's output at one position against the features"), event


def test_an_lrn_output_no_pool_window_reads_yet_with_a_gradient_is_wrong_not_a_crash():
    """inner_ops.took where the worker's position lies outside every window of the pool after the LRN (a 2 x 2 pool,
    stride 2, leaves a 5 x 5 map's last row out) and it still claims a dy there: a disagreement, not an error."""
    pool, y = MaxPool2D(NumpyBackend(), 2, 2, 0), np.ones(3)
    got, ref, tol = inner_ops.took(pool, np.ones(3 * 2 * 2, np.float32), (3, 5, 5), (4, 0), y, y > 0, 5)
    assert not np.all(np.abs(got - ref) <= tol)
    got, ref, tol = inner_ops.took(pool, np.ones(3 * 2 * 2, np.float32), (3, 5, 5), (3, 0), y, y > 0, 5)
    assert np.all(np.abs(got - ref) <= tol)  # a window holds it, and its feature is y


@pytest.mark.parametrize("pair_with_relu", [True, False])
def test_an_lrns_dx_at_one_position_is_its_backwards_alone_or_after_a_relu(pair_with_relu):
    """inner_ops.lrn_column, from one position's input and dy, against the backend's backward of the whole map
    there: the LRN's alone (an input of both signs), or ReLU + LRN's (its mask), within the bound the check uses."""
    rng, be = np.random.default_rng(4), NumpyBackend()
    lrn = LocalResponseNorm(be, size=5, alpha=0.5, beta=0.75, k=2.0)  # alpha large: the window's term matters
    x, dy = (rng.standard_normal((2, 9, 3, 3)).astype(np.float32) * np.float32(2) for _ in range(2))
    if pair_with_relu:
        _, cache = be.relu_lrn_forward(x, lrn.size, lrn.alpha, lrn.beta, lrn.k)
        dx = be.relu_lrn_backward(dy, cache)
    else:
        _, cache = be.lrn_forward(x, lrn.size, lrn.alpha, lrn.beta, lrn.k)
        dx = be.lrn_backward(dy, cache)
    for i, r, c in itertools.product(range(2), range(3), range(3)):
        ref, size, _ = inner_ops.lrn_column(
            lrn, x[i, :, r, c].astype(np.float64), dy[i, :, r, c].astype(np.float64), pair_with_relu
        )
        assert np.all(np.abs(dx[i, :, r, c] - ref) <= float32_tolerance(2 * lrn.size + 3 * FN + 8, size))
        assert pair_with_relu or np.all(ref[x[i, :, r, c] <= 0] != 0)  # alone: no mask where the input is < 0


@pytest.mark.parametrize("norm", ["lrn", "batch"])
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_wrong_dY_the_workers_sums_follow_is_lost_by_one_images_backward_at_its_first_step(parallel, norm):
    """The first max pool's backward 5 % off inside the worker (between conv2's dX and conv1: no op check covers
    it): dW, its projection, the op checks and the logits all agree with it; the master's own backward of one image
    does not (replica/image_backward.py): doubted, and lost at the fault's first step by a second image. (1 % shows
    at some images only, with batch norm, on a network this small: bench_spot_check.py measures 1 % at the paper's
    size.)"""
    wrong = lambda: WrongDx("maxpool_backward", 1.05, at=5, every=2)  # noqa: E731  (pool2's call, then pool1's)
    make = lambda i: Worker(wrong()) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        train(run, 6, norm, every_kernel=False, replays=False)
    (event,) = run.pop_events()
    assert event["step"] == 4 and event["worker"] == "worker1" and run.spot.forgiven == 0, event
    assert event["reason"].startswith("wrong result: image ") and "'s sum of dY^2 at conv1" in event["reason"], event


class OneImageDx(NumpyBackend):
    """A backend whose convolutions' dX is 5 % off at the first image of the slice alone: what a tie broken the
    other way in the worker's forward does to one image's dY (a whole entry differs), and to no other's."""

    def conv2d_backward(self, dy, cache, need_dx=True):
        dx, dw, db = super().conv2d_backward(dy, cache, need_dx)
        if dx is not None:
            dx[:1] *= np.float32(1.05)
        return dx, dw, db


class FirstFirst:
    """A generator whose ``integers`` picks the first of anything (the image to check, and after it the next one)."""

    def integers(self, *args, size=None, **kwargs):
        return 0 if size is None else np.zeros(size, np.int64)

    def __getattr__(self, name):
        return getattr(np.random.default_rng(0), name)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_one_images_e_j_beyond_its_bound_is_forgiven_when_another_image_of_the_slice_agrees(parallel):
    """An e_j beyond its bound at one image alone is doubted, and another image of the slice, checked in the same
    step, clears the worker: it is kept, and the disagreement counted as forgiven."""
    make = lambda i: Worker(OneImageDx()) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        run = runtime(parallel, transport, workers)
        run.spot._rng = FirstFirst()  # each check's first image is the faulty one
        train(run, 6, "batch", every_kernel=False, replays=False)
    assert not run.lost and not run.pop_events(), run.lost
    # steps 2-6 (the first has no probe yet): both workers' images, and worker 1's second each time
    assert run.spot.backwards == 2 * 5 + 5 and run.spot.forgiven >= 5, (run.spot.backwards, run.spot.forgiven)


def test_each_layers_backward_in_absolute_values_bounds_its_backward():
    """magnitudes.magnitude: |J^T dy| <= |J|^T |dy| entry by entry (up to round-off), for dX and the parameters'
    gradients, and batch norm's training backward at the slice's own means or at given sums likewise; what the
    replays and the one-image check scale their bounds by."""
    from tinyconv.distributed.replica import image_backward
    from tinyconv.distributed.replica.magnitudes import magnitude
    from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D, ReLU

    be, rng = NumpyBackend(), np.random.default_rng(0)
    x = rng.standard_normal((3, 6, 8, 8), dtype=np.float32)
    layers = [
        Conv2D(be, 6, 4, 3, stride=1, padding=1, need_dx=True, rng=rng),
        Linear(be, 6 * 8 * 8, 5, rng=rng),
        ReLU(be),
        MaxPool2D(be, 3, 2, 1),
        LocalResponseNorm(be, k=2.0),
        BatchNorm2D(be, 6),
    ]
    for layer in layers:
        y = layer.forward(x, training=True)
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dx = layer.backward(dy)
        if isinstance(layer, BatchNorm2D):  # the magnitudes read the slice's statistics from the running ones
            layer.buffers["running_mean"], layer.buffers["running_var"] = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
        bound, grads = magnitude(layer, x, np.abs(dy), params=True)
        assert bound.shape == x.shape and np.all(np.abs(dx) <= bound * (1 + 1e-5) + 1e-30), layer
        for name, a in grads.items():
            assert np.all(np.abs(layer.grads[name]) <= a * (1 + 1e-5) + 1e-30), (layer, name)
        if not isinstance(layer, (ReLU, MaxPool2D, LocalResponseNorm)):  # their sums cancel
            assert np.any(np.abs(dx) < 0.5 * bound), layer
    norm = layers[-1]
    one, dy, sums = (
        x[:1],
        rng.standard_normal((1, 6, 8, 8), dtype=np.float32),
        rng.standard_normal((2, 6), dtype=np.float32),
    )
    exact = np.abs(image_backward._norm_backward(norm, one, dy, *sums, images=3))
    bound = magnitude(norm, one, np.abs(dy), sums, images=3)[0]
    assert np.all(exact <= bound * (1 + 1e-5)) and np.any(exact < 0.5 * bound)
