"""Data parallelism (tinyconv/distributed/replica/): whole replicas on batch slices, gradients summed on the master.

A data-parallel step with LRN equals the single-process step on the whole batch to float32
round-off, whatever the slices; slower workers get fewer images; a lost worker's images go
to the others and the step is redone; the main job runs it over inproc and zmq. In-process
workers (threads) except for the main job over zmq; every wait has a timeout; no test sleeps.
"""

from __future__ import annotations

import re
import threading
import uuid
from contextlib import contextmanager

import numpy as np
import pytest
from float32_expected import Expected, assert_close
from test_distributed import SlowCalibration
from test_example import SMOKE, _processes_with, run_example

from backends.conformance.runner import FN
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import runtime
from tinyconv.distributed.pool import distribute
from tinyconv.distributed.protocol import VERSION, TaskError, check_task
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.batch import UNIT
from tinyconv.distributed.replica.hybrid import Hybrid
from tinyconv.distributed.replica.server import Replicas
from tinyconv.distributed.worker import replica_handlers as worker_replica
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import SoftmaxCrossEntropy
from tinyconv.metrics import read_metrics
from tinyconv.model import paper_net
from tinyconv.optim import SGD
from transports.base import Message
from transports.inproc import InprocTransport

TIMEOUT = 20.0  # generous upper bound for a busy machine; passing tests return long before
SIZE = 16  # 16x16 images keep the replicas small

# float32_tolerance's scale form for paper_net 6:10's gradients on 16x16 images, batch N (as
# tests/test_distributed.py's STEP_K, the batch's sums of N*16*16 products at length N): the loss's
# forward path, the way back to conv1's dw; and, for data parallelism, the rescaling of a slice's
# dlogits by n/N (2 roundings) and the sum of the P participants' gradients (P - 1 additions).
LOSS_K = (3 * 25 + 1) + (5 + 3 + FN) + (6 * 25 + 1) + (5 + 3 + FN) + (10 * 4 * 4 + 1) + (10 + 8 + 3 + 2 * FN)


def step_k(batch: int, participants: int) -> int:
    back = 10 + batch + (2 * 5 + 7 + 2 * FN) + 10 * 25 + batch + (2 * 5 + 7 + 2 * FN) + batch * SIZE * SIZE
    return LOSS_K + back + 2 + participants - 1


@contextmanager
def inproc_pool(n: int, make=None):
    """n in-process workers, each ``make(i)`` (default: a Worker on numpy); closed afterwards."""
    transport = InprocTransport(make or (lambda i: Worker(NumpyBackend())), protocol=VERSION)
    try:
        yield transport, transport.start(n, timeout=TIMEOUT)
    finally:
        transport.close()


def batch(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 3, SIZE, SIZE)).astype(np.float32), rng.integers(0, 10, n)


def single_process_step(x, y, norm="lrn", smoothing=0.0):
    """The reference: one SGD step of paper_net 6:10 on the whole batch in one process (its loss
    label-smoothed by ``smoothing``, as the trainer's)."""
    net = paper_net("6:10", NumpyBackend(), norm, seed=0, image_size=SIZE)
    net.backward(SoftmaxCrossEntropy(net.backend, smoothing)(net.forward(x, training=True), y)[1])
    grads = flat.pack(net, "grads")
    SGD(net, lr=0.1, momentum=0.9, weight_decay=5e-4).step()
    return grads, net


def data_parallel_step(replicas: Replicas, x, y, norm="lrn", smoothing=0.0):
    net = paper_net("6:10", NumpyBackend(), norm, seed=0, image_size=SIZE)
    loss, logits = replicas.train_batch(net, x, y, smoothing)
    grads = flat.pack(net, "grads")
    SGD(net, lr=0.1, momentum=0.9, weight_decay=5e-4).step()
    return grads, net, loss, logits


def assert_same_step(got_grads, got_net, ref_grads, ref_net, k: int) -> None:
    """Every parameter's gradient, and its value after the update, within the scale-form tolerance."""
    start = 0
    for (key, layer, name), n in zip(ref_net.named_params(), flat.sizes(ref_net), strict=True):
        ref = ref_grads[start : start + n]
        assert_close(got_grads[start : start + n], Expected(ref, k), f"d{key}")
        start += n
        assert_close(_param(got_net, key), Expected(layer.params[name], k), key)


def _param(net, key):
    layer_name, name = key.split(".")
    return next(layer for layer in net.layers if layer.name == layer_name).params[name]


@pytest.mark.parametrize("shares", [[3, 1, 3], [1, 4, 2], [0, 5, 2]])
def test_a_data_parallel_step_equals_the_single_process_step(shares):
    """Unequal slices (the master with none, too): the same gradients and updated weights."""
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y)
    with inproc_pool(2) as (transport, workers):
        replicas = Replicas(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
        replicas.set_plan(UNIT, shares)
        grads, net, loss, logits = data_parallel_step(replicas, x, y)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, sum(1 for s in shares if s)))
    ref_logits = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE).forward(x, training=True)
    assert_close(logits, Expected(ref_logits, LOSS_K), "logits")
    record = replicas.last_step
    assert record["shares"] == {UNIT: shares} and record["participants"] == ["master", "worker0", "worker1"]
    weights = 4 * sum(flat.sizes(net))
    images = [4 * n * 3 * SIZE * SIZE + 8 * n for n in shares[1:]]  # float32 pixels, int64 labels
    assert record["participant_bytes_sent"] == [0] + [weights + b if b else 0 for b in images]
    assert record["participant_bytes_recv"] == [0] + [weights + 4 * 10 * n if n else 0 for n in shares[1:]]


def test_label_smoothing_gives_the_single_process_smoothed_step_and_loss():
    """Each slice's (softmax - q) / n scaled by n / N is the whole batch's smoothed gradient; the
    plain cross-entropy's step is not within the tolerance of it, so the comparison can fail."""
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y, smoothing=0.2)
    with inproc_pool(2) as (transport, workers):
        replicas = Replicas(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
        replicas.set_plan(UNIT, [3, 1, 3])
        grads, net, loss, logits = data_parallel_step(replicas, x, y, smoothing=0.2)
        plain_grads, plain_net, plain_loss, _ = data_parallel_step(replicas, x, y)
        with pytest.raises(ValueError, match=r"label smoothing must be in \[0, 1\), got 1.0"):
            replicas.train_batch(paper_net("6:10", NumpyBackend(), seed=0, image_size=SIZE), x, y, 1.0)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, 3))
    assert loss == pytest.approx(SoftmaxCrossEntropy(NumpyBackend(), 0.2)(logits, y)[0], rel=1e-6)
    assert loss != pytest.approx(plain_loss, rel=1e-3)
    with pytest.raises(AssertionError):
        assert_same_step(plain_grads, plain_net, ref_grads, ref_net, step_k(7, 3))


def test_a_wrong_gradient_scale_would_fail_the_comparison():
    """The tolerance is tight enough to catch a slice's mean gradient summed unscaled (n/N missing)."""
    x, y = batch(7)
    ref_grads, _ = single_process_step(x, y)
    net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    net.train_step(x[:3], y[:3])
    part = flat.pack(net, "grads")
    net.train_step(x[3:], y[3:])
    unscaled = part + flat.pack(net, "grads")
    with pytest.raises(AssertionError, match="differ by more than"):
        assert_close(unscaled, Expected(ref_grads, step_k(7, 2)), "unscaled")


def test_batch_norm_keeps_per_replica_statistics_and_their_weighted_mean():
    """With batch norm each slice normalises by its own statistics (not the single-process step);
    the master's running mean of the first batch norm (whose input the slices share) is the whole
    batch's update, the slices' means weighted by their images."""
    x, y = batch(6)
    ref_grads, ref_net = single_process_step(x, y, norm="batch")
    with inproc_pool(1) as (transport, workers):
        replicas = Replicas(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
        replicas.set_plan(UNIT, [2, 4])
        grads, net, _, _ = data_parallel_step(replicas, x, y, norm="batch")
    first = next(i for i, layer in enumerate(net.layers) if "running_mean" in layer.buffers)
    got, ref = net.layers[first].buffers["running_mean"], ref_net.layers[first].buffers["running_mean"]
    assert_close(got, Expected(ref, 3 * 25 + 1 + 6 * SIZE * SIZE + 4), "the first running mean")  # conv1, its mean
    assert not np.array_equal(got, np.zeros_like(got))
    with pytest.raises(AssertionError):  # per-replica normalisation: the gradients differ beyond round-off
        assert_close(grads, Expected(ref_grads, step_k(6, 2)), "gradients")


class Metered(Worker):
    """A Worker whose reported times follow a cost model, slowdown x 1 ms per image, so that shares
    from calibration are deterministic; its numbers are the real Worker's."""

    def __init__(self, backend, slowdown: float) -> None:
        super().__init__(backend)
        self.metered = slowdown

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind == "result" and msg.kind == "replica_calibrate":
            reply.header["times"] = [self.metered * msg.header["batch"] * 1e-3]
        elif reply.kind == "result" and msg.kind == "replica_step":
            reply.header["compute_s"] = self.metered * len(msg.arrays["y"]) * 1e-3
        return reply


def test_a_slower_worker_gets_fewer_images_by_eq_1():
    slowdowns = [1.0, 3.0]
    with inproc_pool(2, lambda i: Metered(NumpyBackend(), slowdowns[i])) as (transport, workers):
        replicas = Replicas(transport, workers, NumpyBackend(), master_share="0", recv_timeout=TIMEOUT, image_size=SIZE)
        net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
        calibration = replicas.calibrate(net, batch_size=8)
        assert calibration["participants"] == ["worker0", "worker1"]
        assert calibration["shares"] == {UNIT: [6, 2]}  # weights 3/4 and 1/4 of 8 images
        x, y = batch(8)
        replicas.train_batch(net, x, y)
    assert replicas.last_step["shares"] == {UNIT: [6, 2]}
    assert replicas.last_step["participant_conv_s"] == pytest.approx([6e-3, 6e-3])  # balanced


def test_a_worker_calibrating_past_the_timeout_but_within_ten_times_the_master_is_not_lost(monkeypatch):
    # the master's run "takes" 0.05 s: the worker gets 10 x (1 + 1 repeat) x 0.05 = 1 s, not recv_timeout's 0.2
    net = paper_net("2:4", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    with inproc_pool(1, lambda i: SlowCalibration(NumpyBackend(), 0.5)) as (transport, workers):

        def replicas_timing_own_as(seconds: float) -> Replicas:
            replicas = Replicas(transport, workers, NumpyBackend(), recv_timeout=0.2, image_size=SIZE,
                                calibration_repeats=1)  # fmt: skip
            monkeypatch.setattr(replicas, "_time_own", lambda spec, batch: seconds)
            return replicas

        replicas = replicas_timing_own_as(0.05)
        assert replicas.calibrate(net, batch_size=4)["times"][UNIT][0] == 0.05
        lazy = replicas_timing_own_as(0.001)  # 10 x 2 x 0.001 s < 0.5 s
        got = lazy.calibrate(net, batch_size=4)
        assert "no result for the data-parallel calibration within 0.2 s" in lazy.lost[0]  # lost: the run goes on
        assert got["participants"] == ["master"]


@pytest.mark.parametrize("split_by", [Replicas, Hybrid])
def test_calibration_gives_the_whole_batchs_memory_back_on_the_master_and_the_worker(monkeypatch, split_by):
    # each participant times the whole batch, more than its share of a step: kept (tinyconv/distributed/heap.py),
    # that memory would stay the run's peak, so both sides give it back once they have timed
    released = []
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: released.append("master"))
    monkeypatch.setattr(worker_replica, "release_freed_memory", lambda: released.append("worker"))
    with inproc_pool(1) as (transport, workers):
        split = split_by(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE,
                         calibration_repeats=1)  # fmt: skip
        split.calibrate(paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE), batch_size=4)
    assert released == ["worker", "master"]  # the master's after everyone's timing


class Poisoned(Worker):
    """A worker that answers a replica step with NaN gradients from finite inputs: the master loses it."""

    def handle(self, msg):
        reply = super().handle(msg)
        if msg.kind == "replica_step" and reply.kind == "result":
            reply.arrays["grads"] = np.full_like(reply.arrays["grads"], np.nan)
        return reply


def test_a_worker_lost_mid_step_gives_its_images_to_the_others_and_the_step_is_redone():
    x, y = batch(7)
    ref_grads, ref_net = single_process_step(x, y)
    make = lambda i: Poisoned(NumpyBackend()) if i == 1 else Worker(NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        replicas = Replicas(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
        replicas.set_plan(UNIT, [2, 2, 3])
        grads, net, _, _ = data_parallel_step(replicas, x, y)
    assert_same_step(grads, net, ref_grads, ref_net, step_k(7, 2))
    assert replicas.participants == ["master", "worker0"] and 1 in replicas.lost
    assert sum(replicas.last_step["shares"][UNIT]) == 7
    (event,) = replicas.pop_events()
    assert event["event"] == "worker_lost" and event["worker"] == "worker1" and "non-finite" in event["reason"]


class Hangs(Worker):
    """Hangs in its first step's task, once its transport said "started" (its heartbeats flow), until released."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.released = threading.Event()

    def handle(self, msg):
        if msg.kind in ("replica_step", "hybrid_forward"):
            self.released.wait(TIMEOUT)
            return None
        return super().handle(msg)


@pytest.mark.parametrize("split_by", [Replicas, Hybrid])
def test_a_worker_that_hangs_in_its_first_step_is_lost_at_twice_its_expected_compute_and_a_second(split_by):
    """Uncalibrated, an equal split: e_k is the master's own share of the op, per image, times its images --
    not recv_timeout, which the op would wait before "started" told it the worker was computing."""
    x, y = batch(6)
    hung = Hangs(NumpyBackend())
    with inproc_pool(2, lambda i: hung if i == 1 else Worker(NumpyBackend())) as (transport, workers):
        split = split_by(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, image_size=SIZE)
        try:
            split.train_batch(paper_net("6:10", NumpyBackend(), seed=0, image_size=SIZE), x, y)
        finally:
            hung.released.set()
    (event,) = split.pop_events()
    assert event["worker"] == "worker1" and split.participants == ["master", "worker0"]
    assert re.fullmatch(r"no result for the .* 1 within 2 x its expected \S+ s of compute \+ 1 s", event["reason"])


def test_replica_tasks_are_checked_before_any_work():
    x, y = batch(2)
    params = np.zeros(5, np.float32)
    net = {"arch": "6:10", "norm": "lrn", "pool_kernel": 3, "num_classes": 10, "in_channels": 3, "image_size": SIZE}
    good = Message("replica_step", {"task": 1, "step": 1, "net": net, "batch": 2}, {"x": x, "y": y, "params": params})
    check_task(good)
    with pytest.raises(TaskError, match="labels and must be int32 or int64"):
        check_task(Message("replica_step", good.header, {**good.arrays, "y": y.astype(np.float32)}))
    with pytest.raises(TaskError, match="takes the arrays"):
        check_task(Message("replica_step", good.header, {"x": x, "params": params}))
    with pytest.raises(TaskError, match="smoothing"):
        check_task(Message("replica_step", {**good.header, "smoothing": "0.1"}, good.arrays))
    worker = Worker(NumpyBackend())
    reply = worker.handle(Message("replica_step", {**good.header, "smoothing": 1.5}, good.arrays))
    assert reply.kind == "error" and "smoothing must be in [0, 1) (label smoothing), got 1.5" in reply.header["message"]
    reply = worker.handle(good)  # 5 parameters where the replica has thousands
    assert reply.kind == "error" and "params vector of this network has shape" in reply.header["message"]
    huge = Message("replica_calibrate", {"task": 2, "net": {**net, "arch": "60000:60000"}, "batch": 64, "repeats": 1})
    reply = Worker(NumpyBackend(), max_calibrate_bytes=1 << 30).handle(huge)
    assert reply.kind == "error" and "above this worker's limit" in reply.header["message"]


def test_distribute_data_parallel_starts_inproc_workers_and_stops_them():
    net = paper_net("6:10", NumpyBackend(), "lrn", seed=0, image_size=SIZE)
    with distribute(net, "inproc", 1, parallel="data", batch_size=4, image_size=SIZE, recv_timeout=TIMEOUT) as replicas:
        assert sum(replicas.calibration["shares"][UNIT]) == 4
        replicas.train_batch(net, *batch(4))
        assert replicas.last_step["parallel"] == "data"


# ---- the main job ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["inproc", "zmq"])
def test_the_main_job_trains_data_parallel(tmp_path, transport):
    metrics = tmp_path / "run.jsonl"
    where = ("--bind", f"ipc:///tmp/tinyconv-test-{uuid.uuid4().hex[:12]}.sock") if transport == "zmq" else ()
    out = run_example(*SMOKE, "--norm", "lrn", "--steps", "3", "--parallel", "data", "--transport", transport,
                      "--workers", "1", *where, "--metrics-out", str(metrics))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "calibrated shares (master, worker0): images" in out.stdout
    events = read_metrics(metrics)
    assert events[0]["parallel"] == "data"
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 3 and all(e["parallel"] == "data" and sum(e["shares"][UNIT]) == 32 for e in steps)
    assert all(e["bytes_sent"] > 0 and e["bytes_recv"] > 0 for e in steps)
    if transport == "zmq":
        assert _processes_with(where[1]) == []


@pytest.mark.parametrize(("value", "said"), [("pipeline", "must be one of model, data, hybrid")])
def test_a_bad_parallel_value_is_one_clear_line(value, said):
    out = run_example(*SMOKE, "--parallel", value)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1
    assert re.search(said, out.stderr), out.stderr
