"""A slow link (issue #13): a worker whose bytes take long is given the time to move them and
loses kernels to one on a fast link; a hung worker is still lost, at 2 x its expected compute + 1 s
from its "started" (issue #37). The transport delivers by a fake clock that the master's deadlines
read too: no sleeps, no real waiting, exact numbers."""

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
from transports.base import Message, Transport, WorkerInfo, still_computing
from transports.session.worker import call_handler

RECV_TIMEOUT = 10_000.0  # fake seconds: the deadline before anything is measured
MS_PER_KERNEL = 1e-3  # every worker's compute, per kernel and op
WITHIN = "no result for the forward of conv1 within"


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
    its result reports, and the result reaches the master after its bytes' time; the worker's
    "started" and "computed" (``call_handler``'s) come as its compute begins and ends. recv() moves the
    clock to the next arrival, or on by its timeout if that is sooner. ``hung``: workers that say they
    started a task, and then nothing more (their heartbeats, which this transport has none of, flow)."""

    name = "throttled"

    def __init__(self, seconds_per_byte: list[float], clock: Clock) -> None:
        self.links, self.clock = seconds_per_byte, clock
        self.workers = [Metered(NumpyBackend()) for _ in seconds_per_byte]
        self.free = [0.0] * len(seconds_per_byte)  # when each worker is done with what it has
        self.hung: set[int] = set()
        self.started: dict[int, float] = {}  # worker -> when it said it started its last task
        self.arrivals: list[tuple[float, int, int, Message]] = []  # heap: (time, order, worker, result)
        self.order = itertools.count()

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        return [WorkerInfo(k, "numpy", {"device": f"cpu{k}"}, hostname="elsewhere") for k in range(n_workers)]

    def send(self, worker: int, msg: Message) -> None:
        said: list[Message] = []
        reply = call_handler(self.workers[worker], msg, said.append)
        start = max(self.clock.now + msg.nbytes() * self.links[worker], self.free[worker])
        self.free[worker] = start + reply.header.get("compute_s", 0.0)
        arrival = self.free[worker] + reply.nbytes() * self.links[worker]
        self.started[worker] = start
        # its "started" as its compute begins, "computed" as it ends; a "started" again, evenly between
        said_at = [start + (self.free[worker] - start) * i / (len(said) - 1) for i in range(len(said))]
        timeline = [*zip(said_at, said, strict=True), (arrival, reply)]
        for at, message in timeline[: 1 if worker in self.hung else None]:  # hung: its "started", no more
            heapq.heappush(self.arrivals, (at, next(self.order), worker, message))

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
    links: list[float], rng, c_out: int, rebalance: bool, calibrate: bool = True, master_share: str = "0"
) -> tuple[Cluster, Network, Clock]:
    """A cluster of workers on ``links`` (seconds per byte), the master only coordinating (or, "auto", taking
    a share), for a one-conv network of ``c_out`` kernels split as in the paper (by kernels, no fused tail);
    calibrated, or equal. No spot check: its probe, sent when its credit pays for it, would move the bytes."""
    be, clock = NumpyBackend(), Clock()
    transport = Throttled(links, clock)
    workers = transport.start(len(links))
    net = Network(be, [Conv2D(be, 3, c_out, 3, 1, 1, rng=rng)])
    cluster = Cluster(transport, workers, be, master_share=master_share, split="kernels", fuse=False,
                      rebalance=rebalance, recv_timeout=RECV_TIMEOUT, spot_check=0)  # fmt: skip
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


def hang(cluster: Cluster, net: Network, rng, k: int) -> tuple[dict, float]:
    """Worker k hangs in its next task, after its "started": the step's event, and how long it took the master
    to lose it from then."""
    cluster.transport.hung.add(k)
    lost_at, lose = [], cluster.lose
    cluster.lose = lambda workers, refuse=False: (lost_at.append(cluster.rpc.clock()), lose(workers, refuse))
    step(net, rng)
    (event,) = cluster.pop_events()
    assert event["worker"] == f"worker{k}"
    return event, lost_at[0] - cluster.transport.started[k]


def test_a_worker_whose_bytes_take_minutes_is_not_lost_and_a_hung_one_is_at_twice_its_compute_and_a_second(rng):
    """Its transfers are the link's (alive while its bytes flow), its compute has a deadline: the first step,
    by the calibration, moves a minute's bytes each way and is never cut; then a worker that hangs in its
    compute costs 2 x what that took and a second, not its transfer time, nor recv_timeout."""
    cluster, net, clock = cluster_on([0.01], rng, c_out=8, rebalance=False)  # 100 bytes a second
    block = cluster.blocks[0]
    assert cluster.expect(block, 2, "forward")[0] == {0: pytest.approx(2 * MS_PER_KERNEL * 8)}  # calibrated
    starts = []
    for _ in range(3):
        starts.append(clock.now)
        step(net, rng)
    assert cluster.pop_events() == [] and cluster.participants == ["worker0"]
    op_s = (clock.now - starts[-1]) / 2  # a forward or a backward: each moves 6528 bytes
    assert op_s == pytest.approx(65.28 + 8e-3)  # bytes at 100/s and 8 kernels' compute: a minute past its deadline
    assert cluster.rpc.link(0).seconds_per_byte() == pytest.approx(0.01)
    expected = MS_PER_KERNEL * 8  # its compute per kernel and image, measured, for its 8 kernels of 2 images
    assert cluster.expect(block, 2, "forward")[0] == {0: pytest.approx(expected)}

    event, took = hang(cluster, net, rng, 0)
    assert event["reason"] == f"{WITHIN} 2 x its expected {expected:.3g} s of compute + 1 s"
    assert took == pytest.approx(2 * expected + 1)  # from its "started", whatever its link
    assert cluster.participants == ["master"]


@pytest.mark.parametrize("calibrate", [True, False], ids=["calibrated", "equal plan, master share on"])
def test_a_worker_that_hangs_in_its_first_step_costs_twice_its_expected_compute_and_a_second(rng, calibrate):
    """Not recv_timeout, even before a step measured anything: by the calibration (its part of its time for the
    whole layer), or, uncalibrated, by the master's own share of the op (the equal plan assumes equal speeds)."""
    cluster, net, clock = cluster_on([1e-4, 1e-4], rng, 8, False, calibrate, "0" if calibrate else "auto")
    event, took = hang(cluster, net, rng, 1)
    expected = float(event["reason"].split("its expected ")[1].split(" s")[0])
    if calibrate:  # 4 of the 8 kernels; the calibration timed a forward and a backward of all 8
        assert expected == pytest.approx(2 * MS_PER_KERNEL * 8 * 4 / 8)
    assert event["reason"] == f"{WITHIN} 2 x its expected {expected:.3g} s of compute + 1 s"
    assert took == pytest.approx(2 * expected + 1, abs=1e-3) and took < RECV_TIMEOUT / 1000
    assert cluster.participants == (["worker0"] if calibrate else ["master", "worker0"])


class Tuning(Metered):
    """A Worker whose next forward takes ``slower`` times its measured compute, as a device's first run of a new
    shape does (building kernels, an autotuner timing its variants), and says so ``notes`` times on the way
    (``still_computing``, which the OpenCL backend calls after each build and timed variant)."""

    slower, notes = 1.0, 0

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if msg.kind == "block_forward" and self.slower > 1:
            reply.header["compute_s"] *= self.slower
            for _ in range(self.notes):
                still_computing.get()()
            self.slower = 1.0
        return reply


@pytest.mark.parametrize("notes", [0, 40])
def test_a_worker_tuning_a_new_shape_is_kept_while_it_says_it_still_computes(rng, notes):
    """A first run 20 times the measured compute is past the deadline, 2 e + 1 s: a worker that says nothing
    on the way is lost at the deadline; one whose backend says "still computing" every half of its expected
    time is not, and the step completes."""
    cluster, net, clock = cluster_on([1e-9], rng, c_out=8, rebalance=False)
    step(net, rng)
    expected = cluster.expect(cluster.blocks[0], 2, "forward")[0][0]
    tuning = cluster.transport.workers[0] = Tuning(NumpyBackend())
    tuning.slower, tuning.notes = 20 * (2 * expected + 1) / expected, notes  # 20 x its deadline, in 41 stretches
    step(net, rng)
    events = cluster.pop_events()
    if notes:
        assert events == [] and cluster.participants == ["worker0"]
    else:
        assert [e["reason"] for e in events] == [f"{WITHIN} 2 x its expected {expected:.3g} s of compute + 1 s"]


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
