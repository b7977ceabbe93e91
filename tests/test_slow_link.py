"""A slow link (issue #13): a worker whose bytes take long is given the time to move them and
loses kernels to one on a fast link; a silent worker is still lost. The transport delivers by a
fake clock that the master's deadlines read too: no sleeps, no real waiting, exact numbers."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import Conv2D
from tinyconv.model import Network
from transports.base import Message, Transport, WorkerInfo

RECV_TIMEOUT = 10_000.0  # fake seconds: the deadline before anything is measured
MS_PER_KERNEL = 1e-3  # every worker's compute, per kernel and op


class Clock:
    """Fake seconds; only the transport moves them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Metered(Worker):
    """A Worker whose reported compute is MS_PER_KERNEL per kernel of each op (a calibration, a
    forward and a backward of all F kernels, twice that): what its compute takes on the fake clock."""

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind != "result":
            return reply
        if msg.kind == "calibrate":
            reply.header["times"] = [2 * MS_PER_KERNEL * spec["w"][0] for spec in msg.header["layers"]]
            reply.header["compute_s"] = sum(reply.header["times"])
        else:
            kernels = msg.arrays["w"].shape[0] if msg.kind == "block_forward" else msg.arrays["dy"].shape[1]
            reply.header["compute_s"] = MS_PER_KERNEL * kernels
        return reply


class Throttled(Transport):
    """Workers behind links of ``seconds_per_byte[k]``, on ``clock``: a task reaches worker k after
    its array bytes' time on the link, waits for the worker's previous task, takes the compute_s
    its result reports, and the result reaches the master after its bytes' time. recv() moves the
    clock to the next arrival, or on by its timeout if that is sooner. ``silent``: workers whose
    results never come."""

    name = "throttled"

    def __init__(self, seconds_per_byte: list[float], clock: Clock) -> None:
        self.links, self.clock = seconds_per_byte, clock
        self.workers = [Metered(NumpyBackend()) for _ in seconds_per_byte]
        self.free = [0.0] * len(seconds_per_byte)  # when each worker is done with what it has
        self.silent: set[int] = set()
        self.arrivals: list[tuple[float, int, int, Message]] = []  # heap: (time, order, worker, result)
        self.order = itertools.count()

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        return [WorkerInfo(k, "numpy", {"device": f"cpu{k}"}, hostname="elsewhere") for k in range(n_workers)]

    def send(self, worker: int, msg: Message) -> None:
        reply = self.workers[worker].handle(msg)
        if worker in self.silent:
            return
        reached = self.clock.now + msg.nbytes() * self.links[worker]
        self.free[worker] = max(reached, self.free[worker]) + reply.header.get("compute_s", 0.0)
        arrival = self.free[worker] + reply.nbytes() * self.links[worker]
        heapq.heappush(self.arrivals, (arrival, next(self.order), worker, reply))

    def recv(self, timeout: float) -> tuple[int, Message]:
        if self.arrivals and self.arrivals[0][0] <= self.clock.now + timeout:
            arrival, _, k, reply = heapq.heappop(self.arrivals)
            self.clock.now = max(self.clock.now, arrival)
            return k, reply
        self.clock.now += timeout
        raise TimeoutError(f"nothing within {timeout:g} s")

    def close(self) -> None:
        pass


def cluster_on(
    links: list[float], rng, c_out: int, rebalance: bool, calibrate: bool = True
) -> tuple[Cluster, Network, Clock]:
    """A cluster of workers on ``links`` (seconds per byte), the master only coordinating, for a one-conv
    network of ``c_out`` kernels split as in the paper (by kernels, no fused tail); calibrated, or equal."""
    be, clock = NumpyBackend(), Clock()
    transport = Throttled(links, clock)
    workers = transport.start(len(links))
    net = Network(be, [Conv2D(be, 3, c_out, 3, 1, 1, rng=rng)])
    cluster = Cluster(transport, workers, be, master_share="0", split="kernels", fuse=False,
                      rebalance=rebalance, recv_timeout=RECV_TIMEOUT)  # fmt: skip
    cluster.rpc.clock = clock
    if calibrate:
        cluster.calibrate(net, batch_size=2, image_size=8)
    else:
        cluster.attach(net)
    return cluster, net, clock


def step(net: Network, rng) -> None:
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    y = net.forward(x, training=True)
    net.backward(np.ones_like(y))


def test_a_worker_on_a_slow_link_is_given_its_transfer_time_and_a_silent_one_is_still_lost(rng):
    """The deadline is twice what the worker's last op took -- its bytes at its link's rate, and its compute --
    and a second: a worker on a slow link gets its minutes; one that hangs there costs 2 x that + 1 s."""
    cluster, net, clock = cluster_on([0.01], rng, c_out=8, rebalance=False)  # 100 bytes a second
    block = cluster.blocks[0]
    assert cluster.timeout(block, 2, "forward") == RECV_TIMEOUT  # nothing measured yet
    starts = []
    for _ in range(3):
        starts.append(clock.now)
        step(net, rng)
    assert cluster.pop_events() == [] and cluster.participants == ["worker0"]
    op_s = (clock.now - starts[-1]) / 2  # a forward or a backward: each moves 6528 bytes
    assert op_s == pytest.approx(65.28 + 8e-3)  # bytes at 100/s and 8 kernels' compute: past 10 s
    moved = cluster._moved["conv1"]["worker0"]
    assert moved == 6528 and cluster.rpc.link(0).seconds_per_byte() == pytest.approx(0.01)
    deadline = 2 * op_s + 1
    assert cluster.timeout(block, 2, "forward") == pytest.approx(deadline)
    assert cluster.timeout(block, 4, "backward") == pytest.approx(2 * 2 * op_s + 1)  # twice the images

    cluster.transport.silent.add(0)  # now it never answers
    before = clock.now
    step(net, rng)
    (event,) = cluster.pop_events()
    assert event["worker"] == "worker0"
    assert event["reason"] == f"no result for the forward of conv1 within {deadline:g} s"
    assert clock.now - before == pytest.approx(deadline)  # lost at 2 x its op time + 1 s, long before recv_timeout
    assert cluster.participants == ["master"]


def test_without_calibration_a_hung_worker_costs_twice_its_last_op_and_a_second_from_the_second_step(rng):
    """An equal split, nothing calibrated: the first step may take up to recv_timeout (nothing is known of the
    workers yet); from the second on, a worker that stops answering is lost at 2 x its last op time + 1 s."""
    cluster, net, clock = cluster_on([1e-4, 1e-4], rng, c_out=8, rebalance=False, calibrate=False)
    block = cluster.blocks[0]
    assert cluster.timeout(block, 2, "forward") == RECV_TIMEOUT
    step(net, rng)
    floats = 2 * 3 * 8 * 8 + 4 * 3 * 3 * 3 + 4 + 2 * 4 * 8 * 8  # x, its 4 kernels' w and b; their y back
    op_s = 1e-4 * 4 * floats + 4 * MS_PER_KERNEL  # the bytes on the link, then the compute
    assert cluster.timeout(block, 2, "forward") == pytest.approx(2 * op_s + 1)
    cluster.transport.silent.add(1)
    before = clock.now
    step(net, rng)
    (event,) = cluster.pop_events()
    assert event["reason"] == f"no result for the forward of conv1 within {2 * op_s + 1:g} s"
    assert 2 * op_s + 1 < clock.now - before < 2 * op_s + 1 + 4 * op_s  # then worker0 does the step on its own
    assert cluster.participants == ["worker0"] and cluster.counts["conv1"] == [8]


def test_a_worker_on_a_slow_link_ends_with_fewer_kernels_than_one_on_a_fast_link(rng):
    def final_shares(links: list[float]) -> list[int]:
        cluster, net, _ = cluster_on(links, rng, c_out=32, rebalance=True)
        assert cluster.counts["conv1"] == [16, 16]  # equal compute: eq. 1 splits equally
        for _ in range(20):
            step(net, rng)
        assert cluster.pop_events() == []
        return cluster.last_step["shares"]["conv1"]

    assert final_shares([1e-9, 1e-9]) == [16, 16]  # both fast: transfers are next to nothing
    # at 1 MB/s worker1's 12 kernels move 2 x 9024 bytes a step (x, w, b, y; dy, dx, dw, db): 18 ms on
    # top of its 24 ms of compute, about worker0's 40 ms for 20 kernels
    assert final_shares([1e-9, 1e-6]) == [20, 12]
