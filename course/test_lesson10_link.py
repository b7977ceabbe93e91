"""Grades lesson 10: the step's bytes against tinyconv.lab.eq2's count on layers and splits made up here and against
the bytes of real steps (in-process workers), the messages against those a real step sends, and the step-time
model against tinyconv's simulator (``predict``) for one worker on devices and links made up here."""

from __future__ import annotations

import numpy as np
import pytest

import tinyconv as tc
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.shard.balance import apportion
from tinyconv.distributed.worker.handler import Worker
from tinyconv.lab.eq2 import ConvShape, conv_shapes, equal_counts, kernel_split_bytes
from tinyconv.lab.simulate.devices import Device, LayerCost, SplitCost
from tinyconv.lab.simulate.link_model import LinkModel
from tinyconv.lab.simulate.predict import predict
from transports.inproc import InprocTransport

LESSON = "10_a_slow_link"


def made_up_layers(rng: np.random.Generator) -> tuple[list[ConvShape], list[list[int]]]:
    """A few conv layers of random shapes (strides and paddings as they come: OH from the formula) and a random
    split of each among the master and 1 to 4 workers, some of them without kernels."""
    n, c, h = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(5, 20))
    participants = int(rng.integers(2, 6))
    convs, counts = [], []
    for i in range(int(rng.integers(1, 4))):
        f, k, stride = int(rng.integers(1, 13)), int(rng.choice([1, 3, 5])), int(rng.integers(1, 3))
        pad = int(rng.integers(0, k // 2 + 1))
        o = (h + 2 * pad - k) // stride + 1
        convs.append(ConvShape(f"conv{i + 1}", (n, c, h, h), (f, c, k, k), (n, f, o, o), need_dx=i > 0))
        weights = rng.random(participants) * (rng.random(participants) > 0.3)  # some get nothing
        counts.append(apportion(list(weights), f) if weights.sum() else [f] + [0] * (participants - 1))
        c, h = f, max(2, o // 2)
    return convs, counts


@pytest.mark.parametrize("seed", range(8))
def test_step_bytes_equal_tinyconvs_count_on_made_up_layers(lesson, seed):
    convs, counts = made_up_layers(np.random.default_rng([10, seed]))
    got = tuple(lesson.step_bytes(convs, counts))
    assert got == kernel_split_bytes(convs, counts), f"{convs}, split {counts}"


PAPER_NETS = [("50:500", 64, 32, 2), ("150:800", 7, 24, 4), ("5:3", 1, 16, 3)]  # arch, batch, image size, participants


@pytest.mark.parametrize("arch,batch,size,participants", PAPER_NETS)
def test_step_bytes_of_the_paper_nets(lesson, arch, batch, size, participants):
    convs = conv_shapes(tc.paper_net(arch, backend="numpy", image_size=size), batch, size)
    counts = equal_counts(convs, participants)
    assert tuple(lesson.step_bytes(convs, counts)) == kernel_split_bytes(convs, counts)
    assert tuple(lesson.step_bytes(convs, [[conv.w[0]] + [0] * (participants - 1) for conv in convs])) == (0, 0)


class Counting(InprocTransport):
    """In-process workers; counts the tasks it sends and the results it receives."""

    def __init__(self, workers: int) -> None:
        super().__init__(lambda i: Worker(tc.get_backend("numpy")), protocol=VERSION)
        self.n, self.messages = workers, 0

    def send(self, worker: int, msg) -> None:
        self.messages += msg.kind in ("block_forward", "block_backward")
        super().send(worker, msg)

    def recv(self, timeout: float):
        worker, msg = super().recv(timeout)
        self.messages += msg.kind == "result"
        return worker, msg


def real_step(arch: str, size: int, batch: int, counts: list[list[int]]) -> tuple[list[ConvShape], dict, int]:
    """One training step of the paper's split with the master and len(counts[0]) - 1 in-process workers, the kernels
    as ``counts`` -> the layers, the step's record, and the tasks and results it sent and received."""
    net = tc.paper_net(arch, backend="numpy", image_size=size, seed=batch)
    rng = np.random.default_rng(batch)
    x, y = rng.standard_normal((batch, 3, size, size), dtype=np.float32), rng.integers(0, 10, batch)
    with Counting(len(counts[0]) - 1) as transport:
        cluster = tc.Cluster(transport, transport.start(transport.n, timeout=30), net.backend, split="kernels",
                             fuse=False, rebalance=False)  # fmt: skip
        cluster.attach(net)
        for layer, layer_counts in zip(("conv1", "conv2"), counts, strict=True):
            cluster.set_plan(layer, layer_counts)
        net.train_step(x, y)
        step, messages = cluster.last_step, transport.messages
        cluster.close()
    assert [step["shares"][name] for name in ("conv1", "conv2")] == counts
    return conv_shapes(net, batch, size), step, messages


# uneven splits, a worker idle in one layer, the master idle in one, other sizes
REAL = [
    ("6:10", 16, 3, [[2, 4, 0], [3, 3, 4]]),
    ("4:7", 8, 5, [[0, 4], [2, 5]]),
    ("5:6", 24, 2, [[1, 1, 3], [0, 6, 0]]),
]


@pytest.mark.parametrize("arch,size,batch,counts", REAL)
def test_step_bytes_equal_what_a_real_step_moves(lesson, arch, size, batch, counts):
    convs, step, _ = real_step(arch, size, batch, counts)
    assert tuple(lesson.step_bytes(convs, counts)) == (step["bytes_sent"], step["bytes_recv"])


@pytest.mark.parametrize("arch,size,batch,counts", REAL)
def test_messages_per_step_equal_what_a_real_step_sends(lesson, arch, size, batch, counts):
    _, _, messages = real_step(arch, size, batch, counts)
    assert lesson.messages_per_step(counts) == messages


def test_messages_per_step_by_hand(lesson):
    assert lesson.messages_per_step([[8], [16]]) == 0  # the master alone
    assert lesson.messages_per_step([[0, 8]]) == 4
    assert lesson.messages_per_step([[4, 4, 0], [0, 8, 8], [1, 0, 0, 0]]) == 12


def made_up_device(rng: np.random.Generator, convs: list[ConvShape]) -> Device:
    """A device with random times: each layer fixed + per-kernel seconds, and the rest of a step."""
    costs = {
        fuse: SplitCost(
            float(rng.uniform(0.01, 0.5)),
            tuple(LayerCost(c.name, c.w[0], float(rng.uniform(0, 0.2)), float(rng.uniform(1e-5, 1e-2))) for c in convs),
        )
        for fuse in ("off", "on")
    }
    return Device("made up", "?", "lrn", convs[0].x[0], 1.0, costs)


@pytest.mark.parametrize("seed", range(6))
def test_step_time_is_the_simulators_for_one_worker(lesson, seed):
    """The master only coordinating, one worker with every kernel: the simulator's step is the model's, exactly."""
    rng = np.random.default_rng([11, seed])
    arch = f"{rng.integers(2, 60)}:{rng.integers(2, 200)}"
    convs = conv_shapes(tc.paper_net(arch, backend="numpy"), int(rng.integers(1, 65)))
    device = made_up_device(rng, convs)
    link = LinkModel(str(rng.choice(["wifi", "ethernet"])), float(rng.uniform(1e5, 2e8)), float(rng.uniform(0, 5e-3)))
    shares = [[0, conv.w[0]] for conv in convs]
    want = predict(convs, [device], 2, "off", "kernels", link, shares=shares).step_s
    compute = device.fuse["off"].comp_s + sum(cost.time(cost.kernels) for cost in device.fuse["off"].layers)
    nbytes = sum(kernel_split_bytes(convs, shares))
    got = lesson.step_time(compute, nbytes, link.bandwidth, link.latency, 4 * len(convs))
    assert got == pytest.approx(want, rel=1e-9), f"{arch}, {link}"


def test_step_time_by_hand(lesson):
    assert lesson.step_time(0.5, 5_000_000, 5e6, 0.001, 8) == pytest.approx(1.508)
    assert lesson.step_time(0.0, 0, 1.0, 0.0, 0) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_break_even_bandwidth_makes_the_step_take_as_long_as_the_master_alone(lesson, seed):
    rng = np.random.default_rng([12, seed])
    alone, compute = float(rng.uniform(1, 10)), float(rng.uniform(0.1, 0.9))
    nbytes, latency, messages = int(rng.integers(1, 10**9)), float(rng.uniform(0, 1e-3)), int(rng.integers(0, 100))
    got = lesson.break_even_bandwidth(alone, compute, nbytes, latency, messages)
    assert got == pytest.approx(nbytes / (alone - compute - latency * messages), rel=1e-9)
    assert compute + nbytes / got + latency * messages == pytest.approx(alone, rel=1e-9)


def test_break_even_bandwidth_is_none_where_no_link_is_enough(lesson):
    assert lesson.break_even_bandwidth(1.0, 1.5, 10, 0.0, 0) is None  # the split computes longer already
    assert lesson.break_even_bandwidth(1.0, 0.5, 10, 0.01, 50) is None  # the latencies alone take what is left
    assert lesson.break_even_bandwidth(1.0, 0.5, 10, 0.01, 49) == pytest.approx(10 / 0.01)
