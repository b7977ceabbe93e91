"""The cluster: a convolution split by kernels or by input channels gives the unsharded numbers,
and balances itself.

In-process workers (threads running the Worker on the numpy backend) for almost
everything; one test with two real worker processes over ZeroMQ on loopback.
Every wait is bounded by a timeout; no test sleeps.
"""

from __future__ import annotations

import dataclasses
import re
import time
from contextlib import contextmanager

import numpy as np
import pytest
from float32_expected import Expected, assert_close, conv2d_expected

from backends.conformance.runner import FN
from backends.numpy_backend import NumpyBackend
from tinyconv.data import synthetic_dataset
from tinyconv.distributed.link_speed import LinkSpeed
from tinyconv.distributed.pool import spawn_local_workers, stop_workers
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.rebalance import Rebalancer
from tinyconv.distributed.shard.balance import apportion, slices
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import Conv2D, LocalResponseNorm, MaxPool2D, ReLU
from tinyconv.metrics import MetricsWriter, read_metrics
from tinyconv.model import Network, paper_net
from tinyconv.trainer import TrainConfig, Trainer
from transports.base import Message
from transports.inproc import InprocTransport
from transports.zmq_master import ZmqTransport

TIMEOUT = 20.0  # generous upper bound for a busy machine; passing tests return long before
F4 = 4  # bytes per float32


@contextmanager
def inproc_pool(n: int, make=None):
    """n in-process workers, each ``make(i)`` (default: a Worker on numpy); closed afterwards."""
    transport = InprocTransport(make or (lambda i: Worker(NumpyBackend())), protocol=VERSION)
    try:
        yield transport, transport.start(n, timeout=TIMEOUT)
    finally:
        transport.close()


def conv_and_reference(rng, c_in=3, c_out=7, kernel=3, stride=1, padding=1, need_dx=True):
    """A Conv2D with random weights inside a one-layer Network (its conv1)."""
    be = NumpyBackend()
    conv = Conv2D(be, c_in, c_out, kernel, stride, padding, need_dx, rng=rng)
    conv.params["b"] = rng.standard_normal((c_out,), dtype=np.float32)
    return conv, Network(be, [conv])


def attached(cluster: Cluster, net: Network):
    """Attach ``net`` to ``cluster``; its first (sharded) layer."""
    cluster.attach(net)
    return net.layers[0]


def unsharded(rng, conv, x_shape):
    """A random input of ``x_shape`` and gradient for ``conv``'s output, and the unsharded layer's
    numbers: (x, y, dy, dx or None, dw, db), the last four Expected: the numpy reference with the
    rigorous bound of float32_tolerance (a split only sums the same products in another order)."""
    x = rng.standard_normal(x_shape, dtype=np.float32)
    args = (x, conv.params["w"], conv.params["b"], conv.stride, conv.padding)
    (y,) = conv2d_expected(*args)
    dy = rng.standard_normal(y.value.shape, dtype=np.float32)
    return (x, y, dy, *conv2d_expected(*args, dy, conv.need_dx)[1:])


def block_reference(rng, conv, x):
    """``conv`` followed by ReLU, LRN and a max pool -- a tail with a halo -- as a Network, and its
    unsharded numbers through the plain layers: (net, y, a random gradient g of y, dx, dw, db)."""
    be = conv.backend
    net = Network(be, [conv, ReLU(be), LocalResponseNorm(be, alpha=1.0), MaxPool2D(be, 2, 2)])
    y = net.forward(x)
    g = rng.standard_normal(y.shape, dtype=np.float32)
    d = g
    for layer in reversed(net.layers):
        d = layer.backward(d)
    # float32_tolerance's scale form, k along the path: the conv, the LRN's forward (ReLU and the
    # pool are exact), back through the LRN and the pool (no overlaps), then the conv's dx or dw/db
    f, c, kh, kw = conv.params["w"].shape
    forward = c * kh * kw + 1 + (5 + 3 + FN)
    back = forward + (2 * 5 + 7 + 2 * FN) + 1
    sums = x.shape[0] * x.shape[2] * x.shape[3]  # N*H*W >= N*OH*OW, dw's and db's reduction
    dw, db = (Expected(np.copy(conv.grads[p]), back + sums) for p in ("w", "b"))
    return net, Expected(y, forward), g, Expected(d, back + f * kh * kw), dw, db


def train_steps(block, cluster, x, n):
    """n steps of ``block`` alone (forward of x, backward of ones); each step's record."""
    records = []
    for _ in range(n):
        y = block.forward(x)
        block.backward(np.ones_like(y))
        records.append(cluster.last_step)
    return records


def exact_steps(block, cluster, reference, n):
    """n steps of ``block`` alone on ``reference`` = (x, y, dy, dx, dw, db) from :func:`unsharded`, each
    checked against it; each step's record."""
    x, y_ref, dy, dx_ref, dw_ref, _ = reference
    records = []
    for _ in range(n):
        assert_close(block.forward(x), y_ref)
        assert_close(block.backward(dy), dx_ref)
        assert_close(block.grads["w"], dw_ref)
        records.append(cluster.last_step)
    return records


# ---- sharded == unsharded ----------------------------------------------------------------------

CASES = [
    # workers, master_share, plan (None: the equal split), need_dx, stride, padding
    (1, "0", None, True, 1, 1),
    (1, "auto", [3, 4], True, 1, 2),
    (2, "auto", [1, 5, 1], True, 1, 1),
    (3, "0", [2, 0, 5], True, 1, 0),
    (3, "auto", [0, 3, 3, 1], True, 1, 1),
    (2, "auto", [2, 2, 3], False, 2, 1),
    (2, "0", [4, 3], False, 2, 0),
    (1, "auto", [7, 0], True, 2, 2),  # the master computes every kernel
]


@pytest.mark.parametrize("split", ["kernels", "channels"])
@pytest.mark.parametrize("n, master_share, plan, need_dx, stride, padding", CASES)
def test_sharded_conv_equals_unsharded(rng, n, master_share, plan, need_dx, stride, padding, split):
    conv, net = conv_and_reference(rng, stride=stride, padding=padding, need_dx=need_dx)
    be = conv.backend
    x, y_ref, dy, dx_ref, dw_ref, db_ref = unsharded(rng, conv, (2, 3, 9, 9))

    with inproc_pool(n) as (transport, workers):
        # no spot check: its probe rides on a backward when its credit pays for it, and the bytes below are the split's
        sharded = Cluster(
            transport, workers, be, master_share=master_share, recv_timeout=TIMEOUT, split=split, spot_check=0
        )
        block = attached(sharded, net)
        if plan is not None:
            sharded.set_plan("conv1", plan)
        for _ in range(2):  # a second step reuses the workers' state the right way
            t0 = time.perf_counter()
            assert_close(block.forward(x), y_ref)
            dx = block.backward(dy)
            assert_close(conv.grads["w"], dw_ref)
            assert_close(conv.grads["b"], db_ref)
            if need_dx:
                assert_close(dx, dx_ref)
            else:
                assert dx is None
            record = sharded.last_step
            wall = time.perf_counter() - t0
            # each op's conv is a compute inside it, its comm the rest: together no more than the wall time
            assert record["conv_s"] > 0 and record["comm_s"] >= 0
            assert record["comm_s"] + record["conv_s"] <= wall

    participants = n + (master_share == "auto")
    counts = plan or apportion([1.0] * participants, 7)
    assert record["shares"] == {"conv1": counts}
    assert record["participants"] == (["master"] if master_share == "auto" else []) + [f"worker{i}" for i in range(n)]
    # the first layer (no dX) goes by kernels whatever the split, and so does a layer with fewer input
    # channels (3) than participants; one the master computes alone keeps all of its input channels there
    layer_by_channels = split == "channels" and need_dx and participants <= 3
    channels = apportion([float(k) for k in counts], 3)  # proportional to the kernels
    assert record["channel_shares"] == ({"conv1": channels} if layer_by_channels else {})
    by_channels = layer_by_channels and any(counts[master_share == "auto" :])
    # bytes, split by kernels: every worker with kernels gets x, its w and b rows and its dy channels,
    # and returns its y channels, dw and db rows, and a whole partial dx if the layer needs one.
    # By input channels: it gets x and w of its channels (partial_forward), returns the other kernels'
    # maps of its partial convolution, gets those others' partials summed on its kernels and its
    # b rows (tail_forward) and returns its y channels; backward, it gets its dy channels and returns
    # its conv-output gradient (the size of its y channels, tail_backward), gets the others'
    # (partial_backward) and returns dx and dw of its input channels and all of db
    worker = slice(1, None) if master_share == "auto" else slice(None)
    y_k = y_ref.value.nbytes // 7  # one kernel's maps
    sent, recv = [], []  # per worker
    for k, (c0, c1) in zip(counts[worker], slices(channels)[worker], strict=True):
        to = back = 0
        if k and by_channels:
            c = c1 - c0
            others = y_ref.value.nbytes - k * y_k
            to += x.nbytes // 3 * c + 7 * c * 9 * F4  # partial_forward
            to += k * F4 + (k * y_k if others else 0)  # tail_forward: b, and the sum if anyone else has kernels
            to += k * y_k + others  # backward: dy of its kernels, then the others' dyc
            back += others + k * y_k  # p_lo and p_hi; y
            back += k * y_k + 7 * c * 9 * F4 + 7 * F4 + x.nbytes // 3 * c  # dyc; dw, db, dx
        elif k:
            to += x.nbytes + k * 3 * 9 * F4 + k * F4 + k * y_k
            back += k * y_k + k * 3 * 9 * F4 + k * F4
            if need_dx:
                back += x.nbytes
        sent.append(to)
        recv.append(back)
    assert (record["bytes_sent"], record["bytes_recv"]) == (sum(sent), sum(recv))
    master = [0] if master_share == "auto" else []  # the master sends itself nothing
    assert (record["participant_bytes_sent"], record["participant_bytes_recv"]) == (master + sent, master + recv)
    assert len(record["participant_conv_s"]) == len(counts)
    assert [s > 0 for s in record["participant_conv_s"]] == [c > 0 for c in counts]
    # the step's ops, each within the step: their compute adds up to each participant's, and no
    # participant computes longer than the op's wall time on the master
    assert [(op["layer"], op["op"]) for op in record["ops"]] == [("conv1", "forward"), ("conv1", "backward")]
    per = [sum(op["compute_s"][i] for op in record["ops"]) for i in range(len(counts))]
    assert per == pytest.approx(record["participant_conv_s"])
    assert all(max(op["compute_s"]) <= op["wall_s"] for op in record["ops"])
    assert sum(op["wall_s"] for op in record["ops"]) == pytest.approx(record["comm_s"] + record["conv_s"])
    assert_timed(record)


def assert_timed(record: dict) -> None:
    """Each op's at_s and spans (docs/metrics.md), on the master's clock: the ops one after another from 0, and in
    each every participant's task sent, started, computed and received in that order within the op's wall time,
    all of them known for a participant that computed; the master's sent at its start, received at its end."""
    ops = record["ops"]
    assert ops[0]["at_s"] == 0.0
    assert all(a["at_s"] + a["wall_s"] <= b["at_s"] + 1e-9 for a, b in zip(ops, ops[1:], strict=False))
    for op in ops:
        assert len(op["spans"]) == len(op["compute_s"]) == len(record["participants"])
        for name, span, compute in zip(record["participants"], op["spans"], op["compute_s"], strict=True):
            known = [t for t in span if t is not None]
            assert known == sorted(known) and all(0 <= t <= op["wall_s"] for t in known), (op, name)
            assert compute == 0 or None not in span, (op, name)
            if name == "master" and known:
                assert span[0] == span[1] and span[2] == span[3], op


def test_default_plan_is_an_equal_split(rng):
    conv, net = conv_and_reference(rng, c_out=10)
    with inproc_pool(2) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, recv_timeout=TIMEOUT)
        block = attached(sharded, net)
        block.forward(rng.standard_normal((1, 3, 5, 5), dtype=np.float32))
        assert sharded.counts["conv1"] == [4, 3, 3]


def test_a_new_plan_never_splits_a_forward_from_its_backward(rng):
    conv, net = conv_and_reference(rng)
    be = conv.backend
    x, y_ref, dy, dx_ref, dw_ref, _ = unsharded(rng, conv, (2, 3, 6, 6))
    with inproc_pool(2) as (transport, workers):
        sharded = Cluster(transport, workers, be, recv_timeout=TIMEOUT)
        block = attached(sharded, net)
        sharded.set_plan("conv1", [1, 2, 4])
        block.forward(x)
        sharded.set_plan("conv1", [5, 1, 1])  # takes effect at the next forward
        assert_close(block.backward(dy), dx_ref)
        assert_close(conv.grads["w"], dw_ref)
        assert sharded.last_step["shares"]["conv1"] == [1, 2, 4]


@pytest.mark.parametrize("fused", [False, True], ids=["conv", "conv+relu+lrn+pool"])
@pytest.mark.parametrize(
    "n, master_share, plan, channels",
    [
        (1, "auto", [3, 6], [5, 1]),  # the master most of the input channels, the worker most of the kernels
        (1, "0", [9], [6]),  # a worker alone: nobody else's partial to add
        (2, "auto", [1, 7, 1], [2, 1, 3]),  # slices narrower than the LRN's halo of 4
        (3, "0", [2, 0, 7], [1, 0, 5]),  # a worker without kernels has no channels
        (3, "auto", [0, 4, 4, 1], [0, 3, 2, 1]),  # the master only coordinates this layer
    ],
)
def test_a_channel_split_of_its_own_gives_the_unsharded_numbers(rng, n, master_share, plan, channels, fused):
    conv, net = conv_and_reference(rng, c_in=6, c_out=9)
    be = conv.backend
    x = rng.standard_normal((2, 6, 8, 8), dtype=np.float32)
    if fused:
        net, y_ref, dy, dx_ref, dw_ref, db_ref = block_reference(rng, conv, x)
    else:
        x, y_ref, dy, dx_ref, dw_ref, db_ref = unsharded(rng, conv, x.shape)
    with inproc_pool(n) as (transport, workers):
        sharded = Cluster(transport, workers, be, master_share=master_share, recv_timeout=TIMEOUT, split="channels")
        block = attached(sharded, net)
        sharded.set_plan("conv1", plan, channels)
        for _ in range(2):  # the second step starts from the kept plans
            assert_close(net.forward(x), y_ref)
            assert_close(block.backward(dy), dx_ref)  # the conv's backward covers its fused tail's
            assert_close(conv.grads["w"], dw_ref)
            assert_close(conv.grads["b"], db_ref)
            record = sharded.last_step
            assert record["shares"] == {"conv1": plan} and record["channel_shares"] == {"conv1": channels}
            assert [s > 0 for s in record["participant_conv_s"]] == [c > 0 for c in plan]


@pytest.mark.parametrize("fused", [False, True], ids=["conv", "conv+relu+lrn+pool"])
@pytest.mark.parametrize(
    "n, master_share, plan, channels",
    [
        (1, "auto", [3, 6], [5, 1]),
        (2, "auto", [1, 7, 1], [2, 1, 3]),  # slices narrower than the LRN's halo: sums relayed chunk by chunk
        (1, "0", [9], [6]),  # a worker alone
    ],
)
def test_a_batch_in_chunks_gives_the_unsharded_numbers_and_moves_the_same_bytes(
    rng, n, master_share, plan, channels, fused
):
    conv, net = conv_and_reference(rng, c_in=6, c_out=9)
    x = rng.standard_normal((5, 6, 8, 8), dtype=np.float32)
    if fused:
        net, y_ref, dy, dx_ref, dw_ref, db_ref = block_reference(rng, conv, x)
    else:
        x, y_ref, dy, dx_ref, dw_ref, db_ref = unsharded(rng, conv, x.shape)
    seen = []  # the images of each partial_forward a worker got
    tails = []  # and of each tail_backward: its tail treats images on their own, so by the same chunks

    class Recording(Worker):
        def handle(self, msg: Message) -> Message:
            if msg.kind in ("partial_forward", "tail_backward"):
                (seen if msg.kind == "partial_forward" else tails).append(msg.header["images"])
            return super().handle(msg)

    moved = {}
    with inproc_pool(n, lambda i: Recording(NumpyBackend())) as (transport, workers):
        for pipeline in (2, 0):  # 5 images in chunks [0, 1), [1, 3), [3, 5); then whole
            settings = {"split": "channels", "recv_timeout": TIMEOUT, "pipeline": pipeline}
            cluster = Cluster(transport, workers, conv.backend, master_share=master_share, **settings)
            block = attached(cluster, net)
            cluster.set_plan("conv1", plan, channels)
            seen.clear()
            tails.clear()
            assert_close(net.forward(x), y_ref)
            assert_close(block.backward(dy), dx_ref)
            assert_close(conv.grads["w"], dw_ref)
            assert_close(conv.grads["b"], db_ref)
            moved[pipeline] = (cluster.last_step["bytes_sent"], cluster.last_step["bytes_recv"])
            assert_timed(cluster.last_step)  # a worker's chunks: one span over them all
            workers_with_kernels = sum(1 for c in plan[master_share == "auto" :] if c)
            chunks = [[0, 1, 5], [1, 3, 5], [3, 5, 5]] if pipeline else [[0, 5, 5]]
            assert sorted(seen) == sorted(tails) == sorted(chunks * workers_with_kernels)
            cluster.detach(net)
    assert moved[2] == moved[0]  # the same arrays, cut by images


def test_a_channel_split_that_does_not_fit_is_refused_or_replaced(rng):
    conv, net = conv_and_reference(rng)
    x, y_ref, dy, dx_ref, dw_ref, _ = unsharded(rng, conv, (1, 3, 5, 5))
    with inproc_pool(2) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, master_share="0", recv_timeout=TIMEOUT)
        block = attached(sharded, net)
        for counts, bad in (([4, 3], [3, 1]), ([4, 3], [1, 1]), ([4, 3], [2, 1, 0]), ([4, 3], [-1, 4])):
            with pytest.raises(ValueError, match="channels for conv1 needs 2 counts >= 0 summing to its 3 input"):
                sharded.set_plan("conv1", counts, bad)
        # a partial convolution needs someone's tail to add it to, and a tail someone's partial
        for counts, bad in (([4, 3], [0, 3]), ([4, 3], [3, 0]), ([7, 0], [2, 1])):
            with pytest.raises(ValueError, match=re.escape(f"0 exactly where the kernels are 0 ({counts}); got {bad}")):
                sharded.set_plan("conv1", counts, bad)
        sharded.set_plan("conv1", [4, 3], [1, 2])
        sharded.set_plan("conv1", [5, 2])  # the kept channel split still fits: kept
        shares = []
        for counts in ([5, 2], [7, 0]):  # then one the kept split gives worker1 channels for: replaced
            sharded.set_plan("conv1", counts)
            assert_close(block.forward(x), y_ref)
            assert_close(block.backward(dy), dx_ref)
            assert_close(conv.grads["w"], dw_ref)
            shares.append(sharded.last_step["channel_shares"])
    assert shares == [{"conv1": [1, 2]}, {"conv1": [3, 0]}]


def test_a_layer_with_fewer_input_channels_than_participants_goes_by_kernels(rng):
    # 2 input channels cannot give the master and 2 workers one each: every kernel must still be computed
    conv, net = conv_and_reference(rng, c_in=2, c_out=7)
    x, y_ref, dy, dx_ref, dw_ref, db_ref = unsharded(rng, conv, (2, 2, 6, 6))
    with inproc_pool(2) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, recv_timeout=TIMEOUT, split="channels")
        block = attached(sharded, net)
        assert_close(block.forward(x), y_ref)
        assert_close(block.backward(dy), dx_ref)
        assert_close(conv.grads["w"], dw_ref)
        assert_close(conv.grads["b"], db_ref)
        record = sharded.last_step
    assert record["shares"] == {"conv1": [3, 2, 2]} and record["channel_shares"] == {}


def test_auto_splits_by_channels_only_with_every_worker_on_the_masters_host():
    with inproc_pool(3) as (transport, workers):
        away = dataclasses.replace(workers[1], hostname=workers[1].hostname + "-elsewhere")

        def by_channels(pool: list, split: str = "auto") -> bool:
            return Cluster(transport, pool, NumpyBackend(), split=split).split_by_channels

        assert by_channels(workers[:1]) and by_channels(workers)  # here: bytes are cheap, however many
        assert not by_channels([workers[0], away])  # over a LAN the kernel split moves far fewer bytes
        assert by_channels([workers[0], away], "channels") and not by_channels(workers[:1], "kernels")


def test_a_forward_without_backward_is_not_counted_in_a_step(rng):
    conv, net = conv_and_reference(rng)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    with inproc_pool(1) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, recv_timeout=TIMEOUT, spot_check=0)  # bytes: the split's
        block = attached(sharded, net)
        block.forward(x)  # evaluation: no backward follows
        assert sharded.last_step is None and sharded.step == 0
        records = []
        for _ in range(2):  # training steps
            y = block.forward(x)
            block.backward(np.ones_like(y))
            records.append(sharded.last_step)
    assert sharded.step == 2 and records[0]["shares"] == {"conv1": [4, 3]} and records[0]["rebalanced"] == {}
    assert [(op["layer"], op["op"]) for op in records[0]["ops"]] == [("conv1", "forward"), ("conv1", "backward")]
    assert records[0]["bytes_sent"] == records[1]["bytes_sent"]  # the evaluation's forward is in neither


# ---- the whole network, trained ------------------------------------------------------------------


# float32_tolerance's scale form for paper_net 6:10's losses on 16x16 images, batch 4 (8 in the test):
# forward conv1, LRN, conv2, LRN, fc, softmax; a training step adds the way back to conv1's dw
# (4*16*16 sums: fc's dx, the pools' 4 overlaps, the LRNs, conv2's dx) and the SGD update
LOSS_K = (3 * 25 + 1) + (5 + 3 + FN) + (6 * 25 + 1) + (5 + 3 + FN) + (10 * 4 * 4 + 1) + (10 + 8 + 3 + 2 * FN)
STEP_K = LOSS_K + 10 + 4 + (2 * 5 + 7 + 2 * FN) + 10 * 25 + 4 + (2 * 5 + 7 + 2 * FN) + 4 * 16 * 16 + 6


def train_three_steps(tmp_path, name, cluster_for=None):
    """3 SGD steps of paper_net 6:10 on 16x16 synthetic images, batch 4; returns the metrics events."""
    be = NumpyBackend()
    net = paper_net("6:10", be, seed=0, image_size=16)
    data = synthetic_dataset(n_train=16, n_test=8, image_size=16, seed=0)
    config = TrainConfig(epochs=1, batch_size=4, lr=0.05, max_steps=3, augment=False, eval_batch_size=8, progress=False)
    cluster = cluster_for(net) if cluster_for else None
    metrics = MetricsWriter(tmp_path / f"{name}.jsonl")
    try:
        Trainer(net, data, config, metrics, cluster=cluster).fit()
    finally:
        metrics.close()
    return read_metrics(tmp_path / f"{name}.jsonl")


def test_training_sharded_gives_the_unsharded_losses(tmp_path):
    plain = train_three_steps(tmp_path, "plain")
    with inproc_pool(2) as (transport, workers):

        def sharded_for(net):
            sharded = Cluster(transport, workers, net.backend, recv_timeout=TIMEOUT)
            calibration = sharded.calibrate(net, batch_size=4, image_size=16)
            assert calibration["shapes"]["conv2"] == {"x": [4, 6, 8, 8], "w": [10, 6, 5, 5]}
            assert all(t > 0 for times in calibration["times"].values() for t in times)
            return sharded

        sharded = train_three_steps(tmp_path, "sharded", sharded_for)

    steps = [e for e in plain if e["event"] == "step"]
    sharded_steps = [e for e in sharded if e["event"] == "step"]
    assert len(steps) == len(sharded_steps) == 3
    for i, (a, b) in enumerate(zip(steps, sharded_steps, strict=True)):
        assert_close(b["loss"], Expected(np.asarray(a["loss"]), i * STEP_K + LOSS_K), f"step {i}'s loss")
        assert a["shares"] == {} and a["bytes_sent"] == 0
        assert sum(b["shares"]["conv1"]) == 6 and sum(b["shares"]["conv2"]) == 10
        assert b["participants"] == ["master", "worker0", "worker1"]
        assert b["bytes_sent"] > 0 and b["bytes_recv"] > 0 and b["conv_s"] > 0
        assert b["comp_s"] >= 0 and b["comm_s"] >= 0
        # 2 workers: by input channels (auto), for conv2 only (conv1 has no dX): 6 channels split
        assert list(b["channel_shares"]) == ["conv2"] and sum(b["channel_shares"]["conv2"]) == 6
        ran = [(op["layer"], op["op"]) for op in b["ops"]]  # in the order they ran
        assert ran == [("conv1", "forward"), ("conv2", "forward"), ("conv2", "backward"), ("conv1", "backward")]
        assert_timed(b)
    summary = next(e for e in sharded if e["event"] == "summary")
    assert summary["final_shares"] == sharded_steps[-1]["shares"]
    assert summary["final_channel_shares"] == sharded_steps[-1]["channel_shares"]
    for key in ("bytes_sent", "bytes_recv"):  # each participant's over the run, by name
        per = summary[f"participant_{key}"]
        assert list(per) == sharded_steps[-1]["participants"] and sum(per.values()) == summary[key]
        assert per["master"] == 0 and all(per[w] > 0 for w in ("worker0", "worker1"))
    test_loss = [e["test_loss"] for e in plain if e["event"] == "epoch"]
    got = np.array([e["test_loss"] for e in sharded if e["event"] == "epoch"])
    assert_close(got, Expected(np.array(test_loss), 3 * STEP_K + LOSS_K), "test loss")


def test_calibration_shapes_follow_the_network():
    be = NumpyBackend()
    with inproc_pool(1) as (transport, workers):
        cluster = Cluster(transport, workers, be, calibration_repeats=1)
        net = paper_net("6:10", be, pool_kernel=2, image_size=16)
        shapes = cluster.calibrate(net, 2, image_size=16)["shapes"]
    assert [s["x"] for s in shapes.values()] == [[2, 3, 16, 16], [2, 6, 8, 8]]


# ---- failures are clear -------------------------------------------------------------------------


class FailOnceBackend(NumpyBackend):
    """A device whose first convolution fails, like a GPU out of memory."""

    def __init__(self) -> None:
        self.failed = False

    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of device memory")
        return super().conv2d_forward(x, w, b, stride, padding)


def test_a_worker_error_loses_only_that_worker_and_its_share_is_recomputed_in_the_same_step(rng):
    conv, net = conv_and_reference(rng)
    be = conv.backend
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    (y_ref,) = conv2d_expected(x, conv.params["w"], conv.params["b"], 1, 1)
    make = lambda i: Worker(FailOnceBackend() if i == 1 else NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        sharded = Cluster(transport, workers, be, master_share="0", recv_timeout=TIMEOUT)
        block = attached(sharded, net)
        assert_close(block.forward(x), y_ref)  # worker 0 took worker 1's kernels in the same forward
        why = sharded.lost[1]
        assert "failed the forward of conv1" in why and "RuntimeError: out of device memory" in why
        assert [e["event"] for e in sharded.events] == ["worker_lost"] and sharded.events[0]["reason"] == why
        assert_close(block.forward(x), y_ref)  # and the next step runs on worker 0 alone


def test_a_worker_that_fails_its_calibration_is_lost_and_the_others_are_timed(rng):
    conv, net = conv_and_reference(rng)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    (y_ref,) = conv2d_expected(x, conv.params["w"], conv.params["b"], 1, 1)
    make = lambda i: Worker(FailOnceBackend() if i == 1 else NumpyBackend())  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, recv_timeout=TIMEOUT)
        block = attached(sharded, net)
        got = sharded.calibrate(net, batch_size=2, image_size=6)
        assert "failed the calibration" in sharded.lost[1] and "out of device memory" in sharded.lost[1]
        assert got["participants"] == ["master", "worker0"] and sum(got["shares"]["conv1"]) == conv.out_channels
        assert_close(block.forward(x), y_ref)


def test_bad_configuration_is_refused(rng):
    conv, net = conv_and_reference(rng)
    with inproc_pool(1) as (transport, workers):
        with pytest.raises(ValueError, match="master_share must be 'auto'.* or '0'"):
            Cluster(transport, workers, conv.backend, master_share="half")
        with pytest.raises(ValueError, match="nobody would compute"):
            Cluster(transport, [], conv.backend, master_share="0")
        with pytest.raises(ValueError, match="split must be one of auto, channels, kernels, got 'split'"):
            Cluster(transport, workers, conv.backend, split="split")  # the old name of "kernels"
        sharded = Cluster(transport, workers, conv.backend)
        with pytest.raises(ValueError, match="no attached layer 'conv1'; attached: none"):
            sharded.set_plan("conv1", [3, 4])
        with pytest.raises(ValueError, match="no Conv2D layer: there is nothing to distribute"):
            sharded.attach(Network(conv.backend, [ReLU(conv.backend)]))
        attached(sharded, net)
        with pytest.raises(ValueError, match="already serves another network: detach it first"):
            sharded.attach(conv_and_reference(rng)[1])
        with pytest.raises(ValueError, match="needs 2 counts >= 0 \\(master, worker0\\) summing to its 7"):
            sharded.set_plan("conv1", [3, 3])
        with pytest.raises(ValueError, match="no attached layer 'conv2'"):
            sharded.set_plan("conv2", [3, 4])
        sharded.detach(net)
        assert net.layers == [conv]


# ---- balancing ----------------------------------------------------------------------------------


class MeteredWorker(Worker):
    """A Worker whose reported times follow a cost model: slowdown x 1 ms per kernel.

    The numbers and the slowdown's extra wait are the real Worker's; only the
    reported compute_s (and calibration times) are replaced, so what the master
    balances on does not depend on how busy this machine is.
    """

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind != "result":
            return reply
        if msg.kind == "calibrate":
            reply.header["times"] = [self.state.slowdown * spec["w"][0] * 1e-3 for spec in msg.header["layers"]]
        else:
            kernels = msg.arrays["w"].shape[0] if msg.kind == "block_forward" else msg.arrays["dy"].shape[1]
            reply.header["compute_s"] = self.state.slowdown * kernels * 1e-3
        return reply


class FreeLink(LinkSpeed):
    """A link that costs nothing. The metered workers here report modelled compute times: the real
    time around them is this machine's noise (a tail task reported as 0 s took real time), not a
    transfer, and would blur the splits these tests check exactly (test_slow_link.py has slow links)."""

    def add(self, nbytes: int, seconds: float, step: int | None = None) -> None:
        pass

    def seconds_per_byte(self) -> float:
        return 0.0


def free_links(cluster: Cluster) -> None:
    """The cluster's workers' links cost nothing (:class:`FreeLink`): it balances their modelled compute."""
    cluster.rpc.links = {w.index: FreeLink() for w in cluster.workers}


def metered_pool(slowdowns):
    return inproc_pool(len(slowdowns), lambda i: MeteredWorker(NumpyBackend(), slowdown=slowdowns[i]))


class SlowCalibration(Worker):
    """A Worker that takes ``seconds`` longer over its calibration: a slower device than the master."""

    def __init__(self, backend, seconds: float) -> None:
        super().__init__(backend)
        self.seconds = seconds

    def handle(self, msg: Message) -> Message:
        if msg.kind in ("calibrate", "replica_calibrate"):  # model- and data-parallel
            time.sleep(self.seconds)  # the device's own slowness, not a wait for another thread
        return super().handle(msg)


def test_a_worker_calibrating_past_the_timeout_but_within_ten_times_the_master_is_not_lost(monkeypatch):
    # the master's passes "take" 0.05 s a layer: a worker gets 10 x (1 + 1 repeat) x 0.1 s = 2 s, not
    # the 0.2 s of recv_timeout (conv2 of 300:1000 at batch 256 takes ~40 s a pass on one core)
    import tinyconv.distributed.calibrate as calibrate

    monkeypatch.setattr(calibrate, "time_block", lambda be, spec, repeats: 0.05)
    be = NumpyBackend()
    net = paper_net("2:4", be, seed=0, image_size=8)
    with inproc_pool(1, lambda i: SlowCalibration(NumpyBackend(), 0.5)) as (transport, workers):
        cluster = Cluster(transport, workers, be, recv_timeout=0.2, calibration_repeats=1)
        result = cluster.calibrate(net, batch_size=2, image_size=8)
        assert result["times"]["conv2"][0] == 0.05 and result["times"]["conv2"][1] > 0
        lazy = Cluster(transport, workers, be, recv_timeout=0.2, calibration_repeats=1)
        monkeypatch.setattr(calibrate, "time_block", lambda be, spec, repeats: 0.001)  # 10 x 2 x 0.002 < 0.5
        got = lazy.calibrate(paper_net("2:4", be, seed=0, image_size=8), batch_size=2, image_size=8)
        assert "no result for the calibration within 0.2 s" in lazy.lost[0]  # lost, as in a step: the run goes on
        assert got["participants"] == ["master"]


@pytest.mark.parametrize("split", ["kernels", "channels"])
def test_calibration_splits_by_eq1(rng, split):
    be = NumpyBackend()
    net = paper_net("6:48", be, seed=0, image_size=8)
    with metered_pool([1.0, 2.0, 4.0]) as (transport, workers):
        sharded = Cluster(transport, workers, be, master_share="0", recv_timeout=TIMEOUT, split=split)
        result = sharded.calibrate(net, batch_size=2, image_size=8)
    assert set(result) == {"participants", "times", "shares", "channel_shares", "shapes"}
    assert result["participants"] == ["worker0", "worker1", "worker2"]
    assert result["times"]["conv2"] == pytest.approx([0.048, 0.096, 0.192])
    # speeds 1 : 1/2 : 1/4 -> 4/7, 2/7, 1/7 of the kernels: quotas 3.43, 1.71, 0.86 of 6 and
    # 27.43, 13.71, 6.86 of 48, rounded by largest remainder
    assert result["shares"] == {"conv1": [3, 2, 1], "conv2": [27, 14, 7]}
    assert sharded.counts == result["shares"]
    # conv2 split by input channels: its 6 channels alike (conv1, without dX, goes by kernels)
    assert result["channel_shares"] == ({"conv2": [3, 2, 1]} if split == "channels" else {})
    assert sharded.channel_counts == result["channel_shares"]
    # the rebalancer's first point: each participant's time for all of what the layer is split by
    unit = 6 if split == "channels" else 48
    models = [v for model in sharded.rebalancer.cost_models("conv2") for v in model]
    assert models == pytest.approx([0.0, 0.048 / unit, 0.0, 0.096 / unit, 0.0, 0.192 / unit])


class AffineMeteredWorker(Worker):
    """A Worker whose reported times have a fixed part: fixed_s + per_kernel_s x kernels per op.

    Every block_forward and block_backward of k kernels reports fixed_s + per_kernel_s * k
    seconds, and calibration (a forward and a backward of all F kernels of a layer) twice
    that at k = F, so calibration and steps measure the same cost. The numbers are the real
    Worker's; only the reported times are modelled.
    """

    def __init__(self, backend: NumpyBackend, fixed_s: float, per_kernel_s: float) -> None:
        super().__init__(backend)
        self.fixed_s, self.per_kernel_s = fixed_s, per_kernel_s

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind != "result":
            return reply
        if msg.kind == "calibrate":
            reply.header["times"] = [
                2 * (self.fixed_s + self.per_kernel_s * spec["w"][0]) for spec in msg.header["layers"]
            ]
        else:
            kernels = msg.arrays["w"].shape[0] if msg.kind == "block_forward" else msg.arrays["dy"].shape[1]
            reply.header["compute_s"] = self.fixed_s + self.per_kernel_s * kernels
        return reply


def test_calibration_seeds_the_rebalancer_which_balances_fixed_costs(rng):
    # per layer (forward + backward) t = 0.05 + 0.001 k on worker 0 and twice that on worker 1:
    # a fixed part worth 50 kernels, as when every participant builds im2col of the whole input
    conv, net = conv_and_reference(rng, c_in=2, c_out=96)
    x = rng.standard_normal((1, 2, 5, 5), dtype=np.float32)
    costs = [(0.025, 0.0005), (0.05, 0.001)]  # per op
    with inproc_pool(2, lambda i: AffineMeteredWorker(NumpyBackend(), *costs[i])) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, master_share="0", recv_timeout=TIMEOUT, split="kernels")
        free_links(sharded)
        result = sharded.calibrate(net, batch_size=1, image_size=5)
        assert result["times"]["conv1"] == pytest.approx([0.146, 0.292])
        assert result["shares"]["conv1"] == [64, 32]  # eq. 1
        # the calibration is each participant's first measurement, until the first step: all 96 kernels; one
        # k, so proportional
        seeded = [v for model in sharded.rebalancer.cost_models("conv1") for v in model]
        assert seeded == pytest.approx([0.0, 0.146 / 96, 0.0, 0.292 / 96])
        shares = [r["shares"]["conv1"] for r in train_steps(net.layers[0], sharded, x, 16)]
        fitted = [v for model in sharded.rebalancer.cost_models("conv1") for v in model]
    assert fitted == pytest.approx([0.05, 0.001, 0.1, 0.002])
    # after the first step (measured, not judged) and patience (3 steps) the steps' speeds (one k: proportional);
    # after the cool-down (5) and patience the line, T = (96 + 50 + 50) / (1000 + 500) s: k = [80.67, 15.33], kept
    assert shares == [[64, 32]] * 4 + [[71, 25]] * 8 + [[81, 15]] * 4, shares


def test_a_two_times_slower_worker_ends_with_a_third_of_the_kernels(rng):
    conv, net = conv_and_reference(rng, c_in=4, c_out=48)
    be = conv.backend
    x, y_ref, dy, _, dw_ref, _ = unsharded(rng, conv, (2, 4, 6, 6))
    shares = []
    with metered_pool([1.0, 2.0]) as (transport, workers):
        sharded = Cluster(transport, workers, be, master_share="0", recv_timeout=TIMEOUT, split="kernels")
        free_links(sharded)
        block = attached(sharded, net)  # no calibration: starts from the equal split
        for _ in range(12):
            assert_close(block.forward(x), y_ref)
            block.backward(dy)
            assert_close(conv.grads["w"], dw_ref)
            record = sharded.last_step
            shares.append(record["shares"]["conv1"])
            if record["rebalanced"]:
                assert record["rebalanced"] == {"conv1": sharded.counts["conv1"]}
    assert shares[0] == [24, 24]
    assert record["participant_conv_s"] == pytest.approx([2 * 32e-3, 2 * 2 * 16e-3])
    settled = shares.index(shares[-1])
    assert settled <= 5, shares  # patience 3: the move comes after the third lagging step
    assert abs(shares[-1][1] - 16) <= 2 and shares[-1] == [32, 16], shares
    assert all(s == shares[-1] for s in shares[settled:]), shares  # no flapping once balanced


class PartMeteredWorker(Worker):
    """A Worker whose reported times follow a cost model per op, for a layer split by input
    channels: its partial convolution, forward (plus ``fixed_s``) and backward, ``ms`` per input
    channel each; the tail's tasks nothing. Blocks (split by kernels) ``ms`` per kernel;
    calibration, a forward and a backward of all C channels, 2 ``ms`` per channel."""

    def __init__(self, backend: NumpyBackend, ms: float, fixed_s: float = 0.0) -> None:
        super().__init__(backend)
        self.ms, self.fixed_s = ms, fixed_s
        self.channels = 0  # of the last partial_forward, for its backward

    def handle(self, msg: Message) -> Message:
        reply = super().handle(msg)
        if reply.kind != "result":
            return reply
        if msg.kind == "calibrate":
            reply.header["times"] = [2 * self.ms * spec["x"][1] * 1e-3 for spec in msg.header["layers"]]
        elif msg.kind in ("tail_forward", "tail_backward"):
            reply.header["compute_s"] = 0.0
        elif msg.kind == "partial_forward":
            self.channels = msg.arrays["x"].shape[1]
            reply.header["compute_s"] = self.fixed_s + self.channels * self.ms * 1e-3
        elif msg.kind == "partial_backward":
            reply.header["compute_s"] = self.channels * self.ms * 1e-3
        else:
            kernels = msg.arrays["w"].shape[0] if msg.kind == "block_forward" else msg.arrays["dy"].shape[1]
            reply.header["compute_s"] = kernels * self.ms * 1e-3
        return reply


def test_a_two_times_slower_worker_ends_with_a_third_of_the_input_channels(rng):
    # split by input channels, the rebalancer moves channels: 2 ms per channel and step on worker0,
    # 4 on worker1, so [8, 4] of 12 finish together; the kernels (which carry only the tail) follow
    conv, net = conv_and_reference(rng, c_in=12, c_out=24)
    x, y_ref, dy, dx_ref, dw_ref, _ = unsharded(rng, conv, (2, 12, 5, 5))
    records = []
    with inproc_pool(2, lambda i: PartMeteredWorker(NumpyBackend(), ms=[1.0, 2.0][i])) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, master_share="0", recv_timeout=TIMEOUT)
        free_links(sharded)
        block = attached(sharded, net)  # no calibration: starts from the equal split
        for _ in range(10):
            assert_close(block.forward(x), y_ref)
            assert_close(block.backward(dy), dx_ref)
            assert_close(conv.grads["w"], dw_ref)
            records.append(sharded.last_step)
        assert sharded.channel_counts["conv1"] == [8, 4] and sharded.counts["conv1"] == [16, 8]
    channels = [r["channel_shares"]["conv1"] for r in records]
    kernels = [r["shares"]["conv1"] for r in records]
    # the first step measured, not judged; patience 3: the move comes after the next three lagging steps, then stays
    assert channels == [[6, 6]] * 4 + [[8, 4]] * 6, channels
    assert kernels == [[12, 12]] * 4 + [[16, 8]] * 6, kernels
    assert records[0]["participant_conv_s"] == pytest.approx([2 * 6e-3, 2 * 2 * 6e-3])
    assert records[-1]["participant_conv_s"] == pytest.approx([2 * 8e-3, 2 * 2 * 4e-3])
    # what "rebalanced" names: the new kernel counts, once, under the layer's name
    assert [r["rebalanced"] for r in records] == [{}] * 3 + [{"conv1": [16, 8]}] + [{}] * 6


def test_a_worker_that_can_only_slow_a_layer_down_sits_out_and_the_results_stay_exact(rng):
    # worker1's partial convolution has 0.3 s of fixed cost: one channel there takes longer than all 4 on worker0
    conv, net = conv_and_reference(rng, c_in=4, c_out=24)
    reference = unsharded(rng, conv, (2, 4, 6, 6))
    make = lambda i: PartMeteredWorker(NumpyBackend(), ms=1.0, fixed_s=[0.0, 0.3][i])  # noqa: E731
    with inproc_pool(2, make) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, master_share="0", recv_timeout=TIMEOUT)
        free_links(sharded)
        block = attached(sharded, net)
        records = exact_steps(block, sharded, reference, 6)
    assert [r["channel_shares"]["conv1"] for r in records] == [[2, 2]] * 4 + [[4, 0]] * 2
    # no channels, no partial to add to anyone's tail: no kernels either
    assert [r["shares"]["conv1"] for r in records] == [[12, 12]] * 4 + [[24, 0]] * 2
    assert records[3]["rebalanced"] == {"conv1": [24, 0]}
    assert records[-1]["participant_conv_s"][1] == 0  # sent nothing, computed nothing


class SpyRebalancer(Rebalancer):
    """A Rebalancer that records what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int], list[float]]] = []

    def observe(self, layer, counts, times):
        self.calls.append((layer, list(counts), list(times)))
        return super().observe(layer, counts, times)


def test_a_channel_split_layer_the_master_computes_alone_keeps_its_channels_on_the_master(rng):
    # the only worker sits out: the master computes the layer alone (as a split by kernels would), and
    # the rebalancer goes on measuring the layer's input channels, all on the master, forward + backward
    conv, net = conv_and_reference(rng, c_in=4, c_out=24)
    reference = unsharded(rng, conv, (2, 4, 6, 6))
    spy = SpyRebalancer()
    with inproc_pool(1, lambda i: PartMeteredWorker(NumpyBackend(), ms=1.0, fixed_s=0.3)) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, recv_timeout=TIMEOUT, rebalancer=spy)
        free_links(sharded)
        block = attached(sharded, net)
        records = exact_steps(block, sharded, reference, 6)
    assert [r["channel_shares"]["conv1"] for r in records] == [[2, 2]] * 4 + [[4, 0]] * 2
    assert [r["shares"]["conv1"] for r in records] == [[12, 12]] * 4 + [[24, 0]] * 2
    assert all(r["bytes_sent"] == r["bytes_recv"] == 0 for r in records[4:])  # the worker got nothing
    assert len(spy.calls) == 6
    for (layer, counts, times), record in zip(spy.calls, records, strict=True):
        assert layer == "conv1" and counts == record["channel_shares"]["conv1"]
        busy = sum(op["wall_s"] - op["master_waited_s"] for op in record["ops"])  # the master's forward + backward
        assert times == pytest.approx([busy, record["participant_conv_s"][1]])  # the worker's compute, a free link


def test_rebalance_off_keeps_the_plan(rng):
    conv, net = conv_and_reference(rng, c_in=2, c_out=12)
    x = rng.standard_normal((1, 2, 5, 5), dtype=np.float32)
    with metered_pool([1.0, 3.0]) as (transport, workers):
        sharded = Cluster(transport, workers, conv.backend, master_share="0", rebalance=False, split="kernels")
        block = attached(sharded, net)
        assert [r["shares"]["conv1"] for r in train_steps(block, sharded, x, 5)] == [[6, 6]] * 5
        sharded.detach(net)
        eager = Cluster(
            transport, workers, conv.backend, master_share="0", rebalancer=Rebalancer(patience=1), split="kernels"
        )
        block = attached(eager, net)
        first, second = train_steps(block, eager, x, 2)  # the first step measured, not judged
        assert first["rebalanced"] == {} and second["rebalanced"] == {"conv1": [9, 3]}


# ---- real worker processes --------------------------------------------------------------------


def test_sharded_conv_over_zmq_with_worker_processes(rng):
    conv, net = conv_and_reference(rng, c_in=3, c_out=8, stride=2, padding=1)
    be = conv.backend
    x, y_ref, dy, dx_ref, dw_ref, db_ref = unsharded(rng, conv, (2, 3, 9, 9))
    with ZmqTransport(bind="tcp://127.0.0.1:0", protocol=VERSION, heartbeat_s=0.2, peer_timeout_s=10.0) as transport:
        procs = spawn_local_workers(2, transport.bound_address, threads=1)
        try:
            workers = transport.start(2, timeout=TIMEOUT)
            sharded = Cluster(transport, workers, be, recv_timeout=TIMEOUT, split="kernels")
            block = attached(sharded, net)
            sharded.set_plan("conv1", [2, 4, 2])
            assert_close(block.forward(x), y_ref)
            assert_close(block.backward(dy), dx_ref)
            assert_close(conv.grads["w"], dw_ref)
            assert_close(conv.grads["b"], db_ref)
            record = sharded.last_step
            assert record["shares"] == {"conv1": [2, 4, 2]} and record["bytes_recv"] > 2 * x.nbytes

            # a fused tail over the wire: each process computes its slice's ReLU/LRN/pool with the halo
            # -- and the convolution split by input channels: the partials cross the wire
            sharded.detach(net)
            fused_net, out_ref, g, dx_ref, dw_ref, db_ref = block_reference(rng, conv, x)
            fused = Cluster(transport, workers, be, recv_timeout=TIMEOUT, split="channels")
            block = attached(fused, fused_net)
            fused.set_plan("conv1", [2, 4, 2], [1, 1, 1])
            assert_close(fused_net.forward(x), out_ref)
            assert_close(block.backward(g), dx_ref)  # the whole block is the conv's: it takes the pool's dy
            assert_close(conv.grads["w"], dw_ref)
            assert_close(conv.grads["b"], db_ref)
            record = fused.last_step
            assert record["channel_shares"] == {"conv1": [1, 1, 1]} and record["bytes_sent"] > 0
            transport.close()
        finally:
            stop_workers(procs, timeout=5.0)
