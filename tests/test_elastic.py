"""Workers come and go: a lost, silent or untrustworthy worker costs no step, and one that joins
late gets a share. In-process workers on the numpy backend; every wait is bounded; no sleeps."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from echo_worker import answer

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import Conv2D, LocalResponseNorm, MaxPool2D, ReLU
from tinyconv.model import Network, paper_net
from tinyconv.parallel import forward_backward
from transports.base import Message, WorkerInfo
from transports.inproc import InprocTransport
from transports.wire import error_reply

TIMEOUT = 20.0
# DiesAt ends its thread on purpose; pytest would report each death as a warning
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@contextmanager
def pool(makes):
    """In-process workers, worker i made by ``makes[i]`` (a backend -> handler); closed afterwards."""
    transport = InprocTransport(lambda i: makes[i](NumpyBackend()), protocol=VERSION)
    try:
        yield transport, transport.start(len(makes), timeout=TIMEOUT)
    finally:
        transport.close()


def block_net(rng, c_in=4, c_out=12):
    """conv -> ReLU -> LRN -> pool as one network, and its unsharded numbers for a random gradient."""
    be = NumpyBackend()
    conv = Conv2D(be, c_in, c_out, 3, 1, 1, rng=rng)
    net = Network(be, [conv, ReLU(be), LocalResponseNorm(be, alpha=1.0), MaxPool2D(be, 2, 2)])
    x = rng.standard_normal((2, c_in, 8, 8), dtype=np.float32)
    y = net.forward(x)
    g = rng.standard_normal(y.shape, dtype=np.float32)
    net.backward(g)
    return net, conv, (x, g, y, np.copy(conv.grads["w"]), np.copy(conv.grads["b"]))


def assert_close(got, ref):
    err, tol = float(np.abs(got - ref).max()), 1e-5 * float(np.abs(ref).max()) + 1e-7
    assert got.shape == ref.shape and err <= tol, (err, tol)


def exact_step(net, conv, ref):
    """One step of ``net`` checked against the unsharded ``ref``."""
    x, g, y_ref, dw_ref, db_ref = ref
    assert_close(net.forward(x), y_ref)
    net.backward(g)
    assert_close(conv.grads["w"], dw_ref)
    assert_close(conv.grads["b"], db_ref)


class DiesAt(Worker):
    """A worker whose thread dies at its ``n``-th task, like a machine switched off."""

    def __init__(self, backend, n: int) -> None:
        super().__init__(backend)
        self.n, self.seen = n, 0

    def handle(self, msg: Message) -> Message:
        self.seen += 1
        if self.seen == self.n:
            raise SystemExit("switched off")
        return super().handle(msg)


class Silent(Worker):
    """Never answers a task, like a hung device (its heartbeats, in-process, never stop)."""

    def handle(self, msg: Message) -> None:
        return None


class Poisoned(Worker):
    """Answers every forward with NaNs, like a broken device or a hostile peer."""

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        for a in reply.arrays.values():
            a.fill(np.nan)
        return reply


@pytest.mark.parametrize("split", ["kernels", "channels"])
@pytest.mark.parametrize("task", [1, 2], ids=["in the forward", "between forward and backward"])
def test_a_worker_lost_mid_step_costs_no_step(rng, split, task):
    net, conv, ref = block_net(rng)
    with pool([Worker, lambda be: DiesAt(be, task)]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, split=split)
        cluster.attach(net)
        exact_step(net, conv, ref)  # the step completes on the master and worker0, with the same numbers
        exact_step(net, conv, ref)
        events = cluster.pop_events()
    assert cluster.participants == ["master", "worker0"] and list(cluster.lost) == [1]
    assert [(e["event"], e["worker"], e["step"]) for e in events] == [("worker_lost", "worker1", 0)]
    assert "its thread died: SystemExit: switched off" in events[0]["reason"]
    assert sum(events[0]["shares"]["conv1"]) == 12 and len(events[0]["shares"]["conv1"]) == 2
    assert cluster.last_step["participants"] == ["master", "worker0"] and cluster.step == 2


def test_a_silent_worker_is_dropped_after_its_timeout_and_the_step_completes(rng):
    net, conv, ref = block_net(rng)
    with pool([Worker, Silent]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), master_share="0", recv_timeout=0.3)
        cluster.attach(net)
        exact_step(net, conv, ref)
        (event,) = cluster.pop_events()
    assert event["worker"] == "worker1" and event["reason"] == "no result for the forward of conv1 within 0.3 s"
    assert cluster.participants == ["worker0"] and cluster.last_step["shares"] == {"conv1": [12]}


def test_a_worker_returning_nans_is_dropped_and_named(rng, caplog):
    net, conv, ref = block_net(rng)
    with pool([Worker, Poisoned]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT)
        cluster.attach(net)
        exact_step(net, conv, ref)
        (event,) = cluster.pop_events()
    assert event["worker"] == "worker1" and "returned non-finite values" in event["reason"]
    assert "worker 1 (numpy on" in caplog.text and "lost: returned non-finite values" in caplog.text


def test_when_every_worker_is_lost_the_master_finishes_alone(rng):
    net, conv, ref = block_net(rng)
    with pool([lambda be: DiesAt(be, 1)]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), master_share="0", recv_timeout=TIMEOUT)
        cluster.attach(net)
        exact_step(net, conv, ref)
    assert cluster.participants == ["master"] and cluster.last_step["shares"] == {"conv1": [12]}


def test_the_split_after_a_loss_follows_the_calibrated_speeds(rng):
    # worker1 (2x slower) dies: the master and worker2 (4x slower) split by eq. 1 on their own times
    net, conv, ref = block_net(rng, c_out=30)
    makes = [lambda be: Worker(be, slowdown=2.0), lambda be: DiesAt(be, 2), lambda be: Worker(be, slowdown=4.0)]
    with pool(makes) as (transport, workers):
        cluster = Cluster(transport, workers[1:] + workers[:1], NumpyBackend(), recv_timeout=TIMEOUT, split="kernels")
        cluster.timings = {"master": {"conv1": 1.0}, "worker0": {"conv1": 2.0}, "worker1": {"conv1": 1.0},
                           "worker2": {"conv1": 4.0}}  # fmt: skip
        cluster.attach(net)
        exact_step(net, conv, ref)
    assert cluster.participants == ["master", "worker0", "worker2"]
    assert cluster.counts["conv1"] == [17, 9, 4]  # weights 4/7, 2/7, 1/7 of 30: 17.1, 8.6, 4.3


class Joining(InprocTransport):
    """In-process workers of which the last joins only after the first step: joined() reports it then."""

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        infos = super().start(n_workers, timeout)
        self.late = infos[-1:]
        return infos[:-1]

    def joined(self) -> list[WorkerInfo]:
        late, self.late = self.late, []
        return late


def test_a_worker_that_joins_late_is_timed_beside_the_steps_and_given_a_share(rng):
    net, conv, ref = block_net(rng)
    transport = Joining(lambda i: Worker(NumpyBackend()), protocol=VERSION)
    with transport:
        workers = transport.start(2, timeout=TIMEOUT)
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT)
        cluster.calibrate(net, batch_size=2, image_size=8)
        exact_step(net, conv, ref)  # master and worker0; worker1 joins at its end and is asked to time itself
        assert cluster.pop_events() == [] and list(cluster.joiners.waiting) == [1]
        k, reply = answer(transport)  # its answer (here the test waits; the master never does)
        assert k == 1 and cluster.rpc.aside(k, reply)
        exact_step(net, conv, ref)  # still master and worker0; at its end worker1 is seated
        (event,) = cluster.pop_events()
        exact_step(net, conv, ref)  # all three
    assert [event[k] for k in ("event", "worker", "step", "backend")] == ["worker_joined", "worker1", 2, "numpy"]
    assert cluster.participants == ["master", "worker0", "worker1"]
    assert set(cluster.timings) == set(cluster.participants)  # the newcomer was timed on the layers' shapes
    assert len(cluster.last_step["shares"]["conv1"]) == 3 and all(cluster.last_step["shares"]["conv1"])


class FailsCalibration(Worker):
    """Answers its calibration with an error, as a device out of memory would."""

    def handle(self, msg: Message) -> Message:
        return error_reply(msg, "out of device memory") if msg.kind == "calibrate" else super().handle(msg)


@pytest.mark.parametrize(
    ("late", "why"),
    [(Silent, "did not answer its calibration within 1 s"), (FailsCalibration, "out of device memory")],
    ids=["silent", "error"],
)
def test_a_joiner_that_fails_its_calibration_blocks_no_step_and_is_left_out_with_the_reason(rng, late, why):
    """One that never answers is left out at its deadline while the steps go on; one that answers with an
    error, at the step boundary after its answer."""
    net, conv, ref = block_net(rng)
    makes = [lambda be: Worker(be), late]
    transport = Joining(lambda i: makes[i](NumpyBackend()), protocol=VERSION)
    with transport:
        workers = transport.start(2, timeout=TIMEOUT)
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=1.0)
        cluster.calibrate(net, batch_size=2, image_size=8)
        steps = 0
        while steps < 10_000 and (steps == 0 or cluster.joiners.waiting):
            exact_step(net, conv, ref)
            steps += 1
        events = cluster.pop_events()
    assert cluster.participants == ["master", "worker0"] and cluster.step == steps
    assert [(e["event"], e["worker"]) for e in events] == [("worker_lost", "worker1")]
    assert events[0]["reason"].startswith("joined, then ") and why in events[0]["reason"]


def test_a_worker_process_killed_mid_run_over_zmq_costs_no_step(rng):
    # two worker processes; one is SIGKILLed after step 2: step 3 and on complete without it, with
    # the same losses as a run that never had it (the split changes who computes, not what)
    import os
    import signal

    from tinyconv.distributed.pool import distribute
    from tinyconv.model import paper_net
    from tinyconv.optim import SGD

    x = rng.standard_normal((4, 3, 16, 16), dtype=np.float32)
    y = rng.integers(0, 10, 4)

    def run(kill_after: int | None) -> tuple[list[float], list[dict]]:
        net = paper_net("6:12", NumpyBackend(), image_size=16)
        opt, losses = SGD(net, lr=0.05, momentum=0.9), []
        with distribute(net, transport="zmq", workers=2, calibrate=False, recv_timeout=TIMEOUT) as cluster:
            for step in range(5):
                if step == kill_after:
                    os.kill(cluster.workers[1].pid, signal.SIGKILL)
                losses.append(net.train_step(x, y))
                opt.step()
            return losses, cluster.pop_events()

    reference, _ = run(None)
    losses, events = run(2)
    assert [(e["event"], e["worker"], e["step"]) for e in events] == [("worker_lost", "worker1", 2)]
    assert losses == pytest.approx(reference, rel=1e-4) and np.all(np.isfinite(losses))


def test_what_a_worker_should_compute_comes_from_the_calibration_then_from_the_steps(rng):
    """The compute deadline's e_k (``rpc.py``: a task has 2 e_k + 1 s from its "started"): nothing before a
    calibration (the op paces an equal split by the master's own share), then the worker's part of its
    calibrated time, scaled to the batch, then its measured compute per kernel and image."""
    net, conv, ref = block_net(rng)
    with pool([Worker]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=1000.0, split="kernels")
        cluster.attach(net)
        block = cluster.blocks[0]
        assert cluster.expect(block, 2, "forward") == ({}, {None: 6, 0: 6})  # the units, for the op to pace by
        cluster.calibrate(net, batch_size=2, image_size=8)
        cluster.timings = {name: {"conv1": 3.0} for name in cluster.timings}  # 3 s for the whole layer
        cluster.set_plan("conv1", [4, 8])
        assert cluster.expect(block, 2, "forward")[0] == {0: 2.0}  # its 8 of the 12 kernels
        assert cluster.expect(block, 1, "backward")[0] == {0: 2.0}  # a smaller batch gets no less
        assert cluster.expect(block, 16, "forward")[0] == {0: 16.0}  # an evaluation batch 8 times larger
        exact_step(net, conv, ref)
        (rate,) = cluster._took[("conv1", "forward")].values()  # its compute per kernel and image
        assert cluster.expect(block, 4, "forward")[0] == {0: pytest.approx(rate * 8 * 4)}


class Scaled(Worker):
    """Answers every task with its numbers times ``factor``: finite, well formed, and wrong."""

    def __init__(self, backend, factor: float) -> None:
        super().__init__(backend)
        self.factor = np.float32(factor)

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        reply.arrays = {k: a * self.factor for k, a in reply.arrays.items()}
        return reply


@pytest.mark.parametrize("factor", [-50.0, 1.01])
def test_a_worker_with_wrong_finite_numbers_is_caught_by_the_spot_check_in_its_first_step(rng, factor):
    """x -50 poison or 1 % off: the spot check loses the worker in the first step, which completes exactly."""
    net, conv, ref = block_net(rng)
    with pool([Worker, lambda be: Scaled(be, factor)]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, split="kernels")
        cluster.attach(net)
        exact_step(net, conv, ref)
        (event,) = cluster.pop_events()
    # x -50 leaves outputs of ReLU and max pool below 0: the floor of every step; 1 % off, the forward's samples
    why = "its smallest output, which ReLU, LRN and max pool leave at 0" if factor < 0 else "its forward, in "
    assert event["worker"] == "worker1" and event["reason"].startswith(f"wrong result: {why}")
    assert cluster.participants == ["master", "worker0"] and cluster.step == 1


def test_without_the_spot_check_a_wrong_worker_goes_unseen(rng):
    """spot_check=0 trusts the workers: what the check is for (and proof that the test above tests it)."""
    net, conv, ref = block_net(rng)
    with pool([Worker, lambda be: Scaled(be, 1.01)]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, split="kernels", spot_check=0)
        cluster.attach(net)
        x, *_ = ref
        y = net.forward(x)
    assert cluster.pop_events() == [] and not np.allclose(y, ref[2], rtol=1e-4)


class Refusing(InprocTransport):
    """Records whom the runtime asks it to refuse (in-process workers cannot come back to be turned away)."""

    refused: list[tuple[int, str]]

    def refuse(self, worker: int, why: str) -> bool:
        self.refused.append((worker, why))
        return False


@pytest.mark.parametrize(("make", "refused"), [(lambda be: Scaled(be, 1.01), True), (Silent, False)])
def test_a_worker_with_wrong_answers_is_refused_and_a_silent_one_is_not(rng, make, refused):
    net, conv, ref = block_net(rng)
    makes = [Worker, make]
    transport = Refusing(lambda i: makes[i](NumpyBackend()), protocol=VERSION)
    transport.refused = []
    with transport:
        workers = transport.start(2, timeout=TIMEOUT)
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=0.5, split="kernels")
        cluster.attach(net)
        exact_step(net, conv, ref)
    assert list(cluster.lost) == [1]
    assert transport.refused == ([(1, cluster.lost[1])] if refused else [])


class Conv2Only:
    """A spot check that looks at worker 1's second conv alone: its first conv's answers go on unchecked."""

    def __call__(self, k, task, reply, be):
        if k == 1 and task.header.get("layer") == 1 and task.kind == "block_forward":
            raise Lost({k: "wrong result: its forward, in image 0 (the test's check)"}, wrong=True)


def test_a_step_that_took_a_wrong_workers_unchecked_answers_runs_again_without_it(rng):
    """Caught in conv2, the worker had already given conv1's numbers, unchecked: the step runs again."""
    x = rng.standard_normal((4, 3, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 4)
    alone = paper_net("6:12", NumpyBackend(), seed=0, image_size=8)
    ref_loss, _ = forward_backward(alone, x, y)
    net = paper_net("6:12", NumpyBackend(), seed=0, image_size=8)
    with pool([Worker, lambda be: Scaled(be, -50.0)]) as (transport, workers):
        cluster = Cluster(transport, workers, NumpyBackend(), recv_timeout=TIMEOUT, split="kernels", rebalance=False)
        cluster.attach(net)
        cluster.rpc.check = Conv2Only()
        loss, _ = cluster.train_batch(net, x, y)
        (event,) = cluster.pop_events()
    assert event["worker"] == "worker1" and cluster.step == 1  # counted once
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for (name, layer, key), (_, ref_layer, _) in zip(net.named_params(), alone.named_params(), strict=True):
        assert_close(layer.grads[key], ref_layer.grads[key]), name
