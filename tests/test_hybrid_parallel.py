"""The hybrid (tinyconv/distributed/replica/hybrid.py): the conv part by data, the classifier on the master.

A hybrid step with LRN equals the single-process step on the whole batch to float32 round-off,
whatever the slices, and moves exactly the bytes its docstring's formula says; slower workers get
fewer images; a worker lost in either round has its images given to the others and the step is
redone; the worker checks the hybrid's tasks before it computes and keeps its forward for the
step's backward only; the main job runs it over inproc and zmq. In-process workers (threads)
except for the main job over zmq; every wait has a timeout; no test sleeps.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from float32_expected import Expected, assert_close
from test_data_parallel import (
    LOSS_K,
    SIZE,
    TIMEOUT,
    assert_same_step,
    batch,
    data_parallel_step,
    inproc_pool,
    single_process_step,
    step_k,
)
from test_example import SMOKE, _processes_with, run_example

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.pool import distribute
from tinyconv.distributed.protocol import TaskError, check_task
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.batch import UNIT
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.distributed.replica.hybrid import Hybrid
from tinyconv.distributed.replica.server import Replicas
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import SoftmaxCrossEntropy
from tinyconv.metrics import read_metrics
from tinyconv.model import paper_net
from transports.base import Message

NET = {"arch": "6:10", "norm": "lrn", "pool_kernel": 3, "num_classes": 10, "in_channels": 3, "image_size": SIZE}


def hybrid(transport, workers, **options) -> Hybrid:
    return Hybrid(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE, **options)


def sizes(norm: str = "lrn") -> tuple[int, int, int]:
    """(P_conv, P, F) of paper_net 6:10 on SIZE x SIZE images."""
    net = paper_net("6:10", NumpyBackend(), norm, seed=0, image_size=SIZE)
    return sum(flat.sizes(conv_part(net))), sum(flat.sizes(net)), math.prod(feature_shape(net, SIZE))


@pytest.mark.parametrize("shares", [[3, 1, 3], [1, 4, 2], [0, 5, 2]])
def test_a_hybrid_step_equals_the_single_process_step(shares):
    """Unequal slices (the master with none, too): the same gradients, classifier and conv layers
    alike, the same updated weights and logits; the bytes are the docstring's formula exactly."""
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y)
    with inproc_pool(2) as (transport, workers):
        h = hybrid(transport, workers)
        h.set_plan(UNIT, shares)
        grads, net, loss, logits = data_parallel_step(h, x, y)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, sum(1 for s in shares if s)))
    ref = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    assert_close(logits, Expected(ref.forward(x, training=True), LOSS_K), "logits")
    assert loss == pytest.approx(ref.loss_fn(ref.forward(x, training=True), y)[0], rel=1e-5)
    record = h.last_step
    assert record["parallel"] == "hybrid" and record["shares"] == {UNIT: shares}
    assert [op["op"] for op in record["ops"]] == ["forward", "backward"]
    assert record["participants"] == ["master", "worker0", "worker1"]
    p_conv, _, f = sizes()
    image = 3 * SIZE * SIZE
    # to worker i: W_conv and its images, then its rows of dL/dfeatures; back: its features, then dW_conv
    assert record["participant_bytes_sent"] == [0] + [4 * (p_conv + n * (image + f)) if n else 0 for n in shares[1:]]
    assert record["participant_bytes_recv"] == [0] + [4 * (n * f + p_conv) if n else 0 for n in shares[1:]]


def test_label_smoothing_gives_the_single_process_smoothed_step_and_loss():
    """The classifier's loss over the whole batch, smoothed on the master: the same step as one process's."""
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y, smoothing=0.2)
    with inproc_pool(2) as (transport, workers):
        h = hybrid(transport, workers)
        h.set_plan(UNIT, [3, 1, 3])
        grads, net, loss, logits = data_parallel_step(h, x, y, smoothing=0.2)
        plain_grads, plain_net, plain_loss, _ = data_parallel_step(h, x, y)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, 3))
    assert loss == pytest.approx(SoftmaxCrossEntropy(NumpyBackend(), 0.2)(logits, y)[0], rel=1e-6)
    assert loss != pytest.approx(plain_loss, rel=1e-3)
    with pytest.raises(AssertionError):
        assert_same_step(plain_grads, plain_net, ref_grads, ref_net, step_k(7, 3))


def test_the_hybrid_moves_fewer_bytes_than_data_parallelism_only_for_slices_below_the_classes():
    """The docstring's comparison, from the two modes' real steps: a worker with 1 image (fewer
    than the 10 classes) costs the hybrid less than data parallelism, one with 11 costs it more."""
    x, y = batch(12)
    moved = {}
    for kind in (Hybrid, Replicas):
        for shares in ([11, 1], [1, 11]):
            with inproc_pool(1) as (transport, workers):
                split = kind(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
                split.set_plan(UNIT, shares)
                data_parallel_step(split, x, y)
                moved[kind.parallel, shares[1]] = split.last_step["bytes_sent"] + split.last_step["bytes_recv"]
    p_conv, p, f = sizes()
    for n in (1, 11):
        assert moved["hybrid", n] - moved["data", n] == 4 * (2 * (p_conv - p) + n * (2 * f - 10)) - 8 * n
    assert moved["hybrid", 1] < moved["data", 1] and moved["hybrid", 11] > moved["data", 11]


def test_batch_norm_is_per_slice_and_its_statistics_the_weighted_mean():
    """With batch norm each slice normalises by its own statistics (not the single-process step);
    the master's first running mean is the whole batch's update."""
    x, y = batch(6)
    ref_grads, ref_net = single_process_step(x, y, norm="batch")
    with inproc_pool(1) as (transport, workers):
        h = hybrid(transport, workers)
        h.set_plan(UNIT, [2, 4])
        grads, net, _, _ = data_parallel_step(h, x, y, norm="batch")
    first = next(i for i, layer in enumerate(net.layers) if "running_mean" in layer.buffers)
    got, ref = net.layers[first].buffers["running_mean"], ref_net.layers[first].buffers["running_mean"]
    assert_close(got, Expected(ref, 3 * 25 + 1 + 6 * SIZE * SIZE + 4), "the first running mean")
    assert not np.array_equal(got, np.zeros_like(got))
    with pytest.raises(AssertionError):  # per-slice normalisation: the gradients differ beyond round-off
        assert_close(grads, Expected(ref_grads, step_k(6, 2)), "gradients")


class Metered(Worker):
    """A Worker whose reported times follow a cost model, slowdown x 1 ms per image of the conv part."""

    def __init__(self, backend, slowdown: float) -> None:
        super().__init__(backend)
        self.metered = slowdown

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind == "result" and msg.kind == "hybrid_calibrate":
            reply.header["times"] = [self.metered * msg.header["batch"] * 1e-3]
        elif reply.kind == "result" and msg.kind in ("hybrid_forward", "hybrid_backward"):
            images = len(msg.arrays["x"] if "x" in msg.arrays else msg.arrays["dfeatures"])
            reply.header["compute_s"] = self.metered * images * 0.5e-3
        return reply


def test_a_slower_worker_gets_fewer_images_by_eq_1():
    slowdowns = [1.0, 3.0]
    with inproc_pool(2, lambda i: Metered(NumpyBackend(), slowdowns[i])) as (transport, workers):
        h = hybrid(transport, workers, master_share="0")
        net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
        calibration = h.calibrate(net, batch_size=8)
        assert calibration["participants"] == ["worker0", "worker1"]
        assert calibration["shares"] == {UNIT: [6, 2]}  # weights 3/4 and 1/4 of 8 images
        h.train_batch(net, *batch(8))
    assert h.last_step["shares"] == {UNIT: [6, 2]}
    assert h.last_step["participant_conv_s"] == pytest.approx([6e-3, 6e-3])  # forward + backward, balanced


class PoisonedForward(Worker):
    def handle(self, msg):
        reply = super().handle(msg)
        if msg.kind == "hybrid_forward" and reply.kind == "result":
            reply.arrays["features"] = np.full_like(reply.arrays["features"], np.nan)
        return reply


class PoisonedBackward(Worker):
    def handle(self, msg):
        reply = super().handle(msg)
        if msg.kind == "hybrid_backward" and reply.kind == "result":
            reply.arrays["grads"] = np.full_like(reply.arrays["grads"], np.nan)
        return reply


@pytest.mark.parametrize("poisoned", [PoisonedForward, PoisonedBackward])
def test_a_worker_lost_in_either_round_gives_its_images_to_the_others_and_the_step_is_redone(poisoned):
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y)
    make = lambda i: poisoned(NumpyBackend()) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        h = hybrid(transport, workers)
        h.set_plan(UNIT, [2, 2, 3])
        grads, net, _, _ = data_parallel_step(h, x, y)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, 2))
    assert h.participants == ["master", "worker0"] and 1 in h.lost
    assert sum(h.last_step["shares"][UNIT]) == 7
    (event,) = h.pop_events()
    assert event["event"] == "worker_lost" and event["worker"] == "worker1" and "non-finite" in event["reason"]


# ---- the worker's side -----------------------------------------------------------------------------------
def forward_task(x, step=1, **arrays) -> Message:
    net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    params = flat.pack(conv_part(net))
    return Message("hybrid_forward", {"task": step, "step": step, "net": NET, "batch": 8}, {"x": x, "params": params,
                                                                                          **arrays})  # fmt: skip


def backward_task(d, step=1) -> Message:
    return Message("hybrid_backward", {"task": 100 + step, "step": step}, {"dfeatures": d})


def test_hybrid_tasks_are_checked_before_any_work():
    x, _ = batch(3)
    _, _, f = sizes()
    good = forward_task(x)
    check_task(good)
    with pytest.raises(TaskError, match="takes the arrays"):
        check_task(Message("hybrid_forward", good.header, {"x": x}))
    with pytest.raises(TaskError, match="must be float32"):
        check_task(backward_task(np.zeros((3, f), np.float64)))
    worker = Worker(NumpyBackend())
    whole = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    reply = worker.handle(forward_task(x, params=flat.pack(whole)))  # the classifier's weights too: refused
    assert reply.kind == "error" and "the conv part's, without the classifier" in reply.header["message"]
    reply = worker.handle(forward_task(np.zeros((3, 3, SIZE + 1, SIZE), np.float32)))
    assert reply.kind == "error" and "does not fit the replica" in reply.header["message"]
    reply = worker.handle(Message("hybrid_forward", {**good.header, "batch": 2}, good.arrays))  # 3 images of 2
    assert reply.kind == "error" and "1 <= n <= batch (2)" in reply.header["message"]


def test_the_worker_keeps_its_forward_for_the_steps_backward_only():
    """A backward needs its step's forward; one of the wrong shape is refused and the forward stays
    for the right one; after the backward, or after another replica task ran the replica, it is gone."""
    x, _ = batch(3)
    _, _, f = sizes()
    d = np.random.default_rng(1).standard_normal((3, f)).astype(np.float32)
    worker = Worker(NumpyBackend())
    reply = worker.handle(backward_task(d))
    assert reply.kind == "error" and "the conv part step 1: nothing kept" in reply.header["message"]
    assert worker.handle(forward_task(x, step=1)).kind == "result"
    reply = worker.handle(backward_task(d, step=2))
    assert reply.kind == "error" and "the conv part's kept forward is of step 1" in reply.header["message"]
    reply = worker.handle(backward_task(d[:2]))
    assert reply.kind == "error" and f"dfeatures must be (3, {f})" in reply.header["message"]
    got = worker.handle(backward_task(d))  # the right one, after the refused ones
    assert got.kind == "result"
    ref = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)  # the same on the master's side
    conv = conv_part(ref)
    conv.forward(x, training=True)
    conv.backward(d.reshape(3, *feature_shape(ref, SIZE)))
    np.testing.assert_array_equal(got.arrays["grads"], flat.pack(conv, "grads"))
    assert worker.handle(backward_task(d)).kind == "error"  # one backward per forward
    assert worker.handle(forward_task(x, step=2)).kind == "result"
    calibrate = Message("hybrid_calibrate", {"task": 7, "net": NET, "batch": 2, "repeats": 1})
    reply = worker.handle(calibrate)
    assert reply.kind == "result" and reply.header["times"][0] > 0
    reply = worker.handle(backward_task(d, step=2))  # calibration ran the replica: the forward is gone
    assert reply.kind == "error" and "nothing kept" in reply.header["message"]


def test_distribute_hybrid_starts_hybrid_workers_and_stops_them():
    net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    with distribute(net, "inproc", 1, parallel="hybrid", batch_size=4, image_size=SIZE, recv_timeout=TIMEOUT) as h:
        assert isinstance(h, Hybrid) and sum(h.calibration["shares"][UNIT]) == 4
        h.train_batch(net, *batch(4))
        assert h.last_step["parallel"] == "hybrid"
    with pytest.raises(ValueError, match="parallel must be one of model, data, hybrid"):
        distribute(net, "inproc", 1, parallel="pipeline")


# ---- the main job ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["inproc", "zmq"])
def test_the_main_job_trains_hybrid(tmp_path, transport):
    metrics = tmp_path / "run.jsonl"
    where = ("--bind", f"ipc:///tmp/tinyconv-test-{uuid.uuid4().hex[:12]}.sock") if transport == "zmq" else ()
    out = run_example(*SMOKE, "--norm", "lrn", "--steps", "3", "--parallel", "hybrid", "--transport", transport,
                      "--workers", "1", *where, "--metrics-out", str(metrics))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "calibrated shares (master, worker0): images" in out.stdout
    assert "the convolutions of a replica (hybrid)" in out.stdout
    events = read_metrics(metrics)
    assert events[0]["parallel"] == "hybrid"
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 3 and all(e["parallel"] == "hybrid" and sum(e["shares"][UNIT]) == 32 for e in steps)
    assert all(e["bytes_sent"] > 0 and e["bytes_recv"] > 0 and e["conv_s"] > 0 for e in steps)
    if transport == "zmq":
        assert _processes_with(where[1]) == []


def test_the_main_job_refuses_a_narrowed_wire_with_the_hybrid():
    out = run_example(*SMOKE, "--parallel", "hybrid", "--wire-precision", "bf16")
    assert out.returncode == 2 and out.stdout == ""
    assert "--parallel hybrid sends its weights, gradients and features in float32" in out.stderr
